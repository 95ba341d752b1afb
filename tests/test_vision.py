"""Vision-language models: a tiny random Qwen2-VL written with transformers (the character
tokenizer with Qwen2-VL's vision tokens, its processor beside it). Prompts in VeRL's multimodal
schema (an `images` column, `<image>` in the prompt) reach the rollout engine with their pictures:
vLLM expands each image pad to the processor's count, and its log-probs of what it samples equal
transformers' given the same pixels (fp32); a picture that cannot be read skips its row, counted;
the eval stage runs the model; training it is refused in one line."""

from __future__ import annotations

import asyncio
import io
import pathlib

import pytest
import torch

from rlsys.models.vision_compat import allow_qwen2_vl_without_torchvision

RL_CONFIG = str(pathlib.Path(__file__).resolve().parents[1] / "examples" / "arith" / "rlvr.yaml")


@pytest.fixture(scope="module")
def tiny_vl_dir(tmp_path_factory) -> str:
    from rlsys.models.tiny_vl import write_tiny_vl_model

    return write_tiny_vl_model(str(tmp_path_factory.mktemp("tiny_vl")))


def dots(count: int) -> bytes:
    """A 56 x 56 PNG of `count` black dots."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (56, 56), "white")
    draw = ImageDraw.Draw(image)
    for i in range(count):
        x, y = 4 + 16 * (i % 3), 4 + 16 * (i // 3)
        draw.ellipse([x, y, x + 12, y + 12], fill="black")
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def dots_file(tmp_path_factory) -> str:
    """4 rows asking how many dots a picture holds (1 to 4), then a row whose picture is not an image
    and one with two <image> markers for its one picture."""
    from datasets import Dataset

    def row(count: int, picture: bytes, question: str = "<image>dots=") -> dict:
        return {"data_source": "arith", "prompt": [{"role": "user", "content": question}],
                "images": [{"bytes": picture, "path": None}], "reward_model": {"ground_truth": str(count)}}

    rows = [row(count, dots(count)) for count in (1, 2, 3, 4)]
    rows += [row(1, b"not a picture"), row(1, dots(1), "<image><image>dots=")]
    path = str(tmp_path_factory.mktemp("dots") / "dots.parquet")
    Dataset.from_list(rows).to_parquet(path)
    return path


def test_prompts_with_pictures_are_sampled_with_them_and_the_trainers_logprobs(tiny_vl_dir, dots_file):
    """The rows' pictures go with their prompts through the single-turn loop to vLLM, one image pad
    each in the prompt's ids; transformers' log-probs of the sampled tokens, given the processor's
    pixels of the same picture, equal the engine's within 1e-4; another picture changes them."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from rlsys.actors.rollout_worker import RolloutWorker
    from rlsys.agents.loop import SingleTurnLoop
    from rlsys.agents.trajectory import Sampling
    from rlsys.config.rollout import RolloutConfig
    from rlsys.data.rl import load_prompts

    allow_qwen2_vl_without_torchvision()
    processor = AutoProcessor.from_pretrained(tiny_vl_dir)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vl_dir, dtype=torch.float32).eval()
    prompts, stats = load_prompts([dots_file], processor.tokenizer)
    assert len(prompts) == 4 and stats.skipped == 2
    image_pad = model.config.image_token_id
    assert all(p.ids.count(image_pad) == 1 and len(p.images) == 1 for p in prompts)

    worker = RolloutWorker(tiny_vl_dir, RolloutConfig(engine_memory_gib=0.1), seed=0, num_threads=2,
                           loops={"single_turn": SingleTurnLoop})
    sampling = Sampling(temperature=1.0, top_p=1.0, max_new_tokens=8, max_response_tokens=8)
    trajectories = asyncio.run(worker.rollout([(i, p.ids, p.row) for i, p in enumerate(prompts)], "single_turn", 1,
                                              sampling, seed=3)).unpack({i: p.ids for i, p in enumerate(prompts)})
    next_token = []
    for prompt, trajectory in zip(prompts, trajectories):
        inputs = processor(text=[prompt.text], images=prompt.images, return_tensors="pt")
        expanded = inputs["input_ids"][0].tolist()
        merge = processor.image_processor.merge_size
        assert expanded.count(image_pad) == int(inputs["image_grid_thw"].prod()) // merge**2 == 4
        sampled = trajectory.response_ids
        ids = torch.tensor([expanded + sampled])
        kinds = torch.cat([inputs["mm_token_type_ids"], torch.zeros(1, len(sampled), dtype=torch.long)], dim=1)
        with torch.no_grad():
            logits = model(input_ids=ids, pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                           mm_token_type_ids=kinds).logits[0]
        logprobs = torch.log_softmax(logits, -1)[len(expanded) - 1:-1].gather(1, torch.tensor(sampled)[:, None])[:, 0]
        assert (logprobs - torch.tensor(trajectory.logprobs)).abs().max() < 1e-4
        next_token.append(torch.log_softmax(logits[len(expanded) - 1], -1))
    assert (next_token[0] - next_token[3]).abs().max() > 1e-2  # the picture matters


def test_the_eval_stage_runs_a_vision_language_model_and_training_it_is_refused(ray_cluster, tiny_vl_dir, dots_file,
                                                                                tmp_path, capsys):
    from rlsys.config.loader import load_config
    from rlsys.config.schema import EvalJobConfig
    from rlsys.run import main
    from rlsys.stages.eval import run_eval

    cfg = load_config(EvalJobConfig, None, [f"output_dir={tmp_path / 'eval'}", f"model.path={tiny_vl_dir}",
                                            f"eval.files=[{dots_file}]", "eval.reward=arith", "eval.max_new_tokens=4",
                                            "eval.engine_memory_gib=0.1", "ray.include_dashboard=false"])
    summary = run_eval(cfg)
    assert summary["num_prompts"] == 4 and summary["skipped_rows"] == 2
    code = main(["rlvr", "--config", RL_CONFIG, f"model.path={tiny_vl_dir}", f"data.train_files=[{dots_file}]",
                 "eval=null"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "is a vision-language model" in err, err
