"""Vision-language models: a tiny random Qwen2-VL written with transformers (the character
tokenizer with Qwen2-VL's vision tokens, its processor beside it) is served by vLLM with images,
the image tokens counted as the model expects, and the engine's log-probs of what it samples
equal transformers' (fp32)."""

from __future__ import annotations

import pytest
import torch

from rlsys.models.vision_compat import allow_qwen2_vl_without_torchvision


@pytest.fixture(scope="module")
def tiny_vl_dir(tmp_path_factory) -> str:
    from rlsys.models.tiny_vl import write_tiny_vl_model

    return write_tiny_vl_model(str(tmp_path_factory.mktemp("tiny_vl")))


def dots(count: int):
    """A 56 x 56 picture of `count` black dots."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (56, 56), "white")
    draw = ImageDraw.Draw(image)
    for i in range(count):
        x, y = 4 + 16 * (i % 3), 4 + 16 * (i // 3)
        draw.ellipse([x, y, x + 12, y + 12], fill="black")
    return image


def test_vllm_serves_a_tiny_qwen2_vl_with_images_and_the_trainers_logprobs(tiny_vl_dir):
    """One <|image_pad|> per image in the prompt's token ids; vLLM expands it to the processor's
    count (grid t x h x w / merge^2) and samples; transformers' log-probs of the sampled tokens,
    given the same pixels, equal the engine's within 1e-4; a different picture changes them."""
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from vllm import SamplingParams, TokensPrompt

    from rlsys.config.rollout import RolloutConfig
    from rlsys.rollout.vllm_engine import create_llm

    allow_qwen2_vl_without_torchvision()
    processor = AutoProcessor.from_pretrained(tiny_vl_dir)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vl_dir, dtype=torch.float32).eval()
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                       {"type": "text", "text": "count="}]}],
                                         add_generation_prompt=True, tokenize=False)
    prompt_ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    image_pad = model.config.image_token_id
    assert prompt_ids.count(image_pad) == 1

    cfg = RolloutConfig(engine_memory_gib=0.1, engine_kwargs={"limit_mm_per_prompt": {"image": 1, "video": 0}})
    llm = create_llm(tiny_vl_dir, cfg, seed=0)
    images = [dots(count) for count in (1, 2, 3, 4)]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=prompt_ids, multi_modal_data={"image": image})
                            for image in images],
                           [SamplingParams(temperature=1.0, max_tokens=8, logprobs=0, seed=seed) for seed in range(4)])
    first_token_logprobs = []
    for image, output in zip(images, outputs):
        inputs = processor(text=[text], images=[image], return_tensors="pt")
        expanded = inputs["input_ids"][0].tolist()
        merge = processor.image_processor.merge_size
        assert expanded.count(image_pad) == int(inputs["image_grid_thw"].prod()) // merge**2 == 4
        assert list(output.prompt_token_ids) == expanded
        sampled = list(output.outputs[0].token_ids)
        engine = torch.tensor([next(iter(d.values())).logprob for d in output.outputs[0].logprobs])
        ids = torch.tensor([expanded + sampled])
        kinds = torch.cat([inputs["mm_token_type_ids"], torch.zeros(1, len(sampled), dtype=torch.long)], dim=1)
        with torch.no_grad():
            logits = model(input_ids=ids, pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                           mm_token_type_ids=kinds).logits[0]
        logprobs = torch.log_softmax(logits, -1)[len(expanded) - 1:-1].gather(1, torch.tensor(sampled)[:, None])[:, 0]
        assert (logprobs - engine).abs().max() < 1e-4
        first_token_logprobs.append(torch.log_softmax(logits[len(expanded) - 1], -1))
    assert (first_token_logprobs[0] - first_token_logprobs[3]).abs().max() > 1e-2  # the picture matters
