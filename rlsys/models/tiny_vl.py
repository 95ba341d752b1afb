"""Tiny vision-language model factory: a Qwen2-VL, Qwen2.5-VL or Qwen3-VL with a small vision tower
and the character-level tokenizer of `rlsys.models.tiny` extended with Qwen's vision tokens, written
as a Hugging Face directory with its processor, which transformers (`AutoProcessor`,
`AutoModelForImageTextToText`) and vLLM load.

An image's content part renders as <|vision_start|><|image_pad|><|vision_end|>; the processor
expands the pad to one token per 2 x 2 patches (of 14 pixels; Qwen3-VL's of 16) after resizing the
image to 4 x 4 patches: 4 tokens.

    python -m rlsys.models.tiny_vl --out runs/tiny-vl-init [--family qwen2_5_vl]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from rlsys.models.tiny import build_tokenizer
from rlsys.models.vision import VL_FAMILIES
from rlsys.models.vision_compat import allow_qwen_vl_without_torchvision

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
VISION_TOKENS = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]
"""Appended after the text tokens, which keep their ids."""

VL_CHAT_TEMPLATE = (
    "{%- if tools -%}<|system|>tools:{%- for t in tools %} {{ t['function']['name'] }}{%- endfor -%}<|end|>"
    "{%- endif -%}"
    "{%- for m in messages -%}<|{{ m['role'] }}|>"
    "{%- if m['content'] is string -%}{{ m['content'] }}"
    "{%- else -%}{%- for p in m['content'] -%}"
    "{%- if p['type'] == 'image' -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif p['type'] == 'text' -%}{{ p['text'] }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}<|end|>{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)
"""`rlsys.models.tiny.CHAT_TEMPLATE` for text content; a list of parts for text and images."""


@dataclass(frozen=True)
class TinyVLSpec:
    family: str = "qwen2_vl"
    """The model type: one of `rlsys.models.vision.VL_FAMILIES`."""
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    """Head size 32: the smallest vLLM's CPU attention takes (and the vision tower's too)."""
    num_key_value_heads: int = 2
    vocab_size: int = 128
    vision_depth: int = 1
    vision_embed_dim: int = 64
    vision_heads: int = 2
    max_position_embeddings: int = 512
    seed: int = 0


def build_vl_tokenizer():
    tokenizer = build_tokenizer()
    tokenizer.add_tokens(VISION_TOKENS, special_tokens=True)
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    return tokenizer


def _classes(family: str) -> tuple[type, type, type]:
    """transformers' config, model and processor classes of `family`."""
    import transformers

    return {
        "qwen2_vl": (transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration,
                     transformers.Qwen2VLProcessor),
        "qwen2_5_vl": (transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration,
                       transformers.Qwen2_5_VLProcessor),
        "qwen3_vl": (transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration,
                     transformers.Qwen3VLProcessor),
    }[family]


def patch_size(spec: TinyVLSpec) -> int:
    """The side of the vision tower's patches, in pixels: Qwen3-VL's are 16, the others' 14."""
    return 16 if spec.family == "qwen3_vl" else 14


def build_vl_model(spec: TinyVLSpec, tokenizer):
    head_dim = spec.hidden_size // spec.num_attention_heads
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in VISION_TOKENS}
    pairs = head_dim // 2  # mrope splits the rotary pairs 1 : 1.5 : 1.5 over time, height and width
    mrope = [pairs // 4, (pairs - pairs // 4) // 2, (pairs - pairs // 4) // 2]
    text = dict(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
                num_key_value_heads=spec.num_key_value_heads, max_position_embeddings=spec.max_position_embeddings,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope},
                bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    vision = dict(depth=spec.vision_depth, num_heads=spec.vision_heads, in_channels=3, patch_size=patch_size(spec),
                  spatial_merge_size=2, temporal_patch_size=2)
    if spec.family == "qwen2_vl":
        vision.update(embed_dim=spec.vision_embed_dim, hidden_size=spec.hidden_size, mlp_ratio=2)
    else:  # the vision tower's width, and the merger's output: the language model's
        vision.update(hidden_size=spec.vision_embed_dim, intermediate_size=2 * spec.vision_embed_dim,
                      out_hidden_size=spec.hidden_size)
    if spec.family == "qwen2_5_vl":  # one more block first, attending within windows of one image token each
        vision.update(depth=spec.vision_depth + 1, window_size=2 * patch_size(spec),
                      fullatt_block_indexes=list(range(1, spec.vision_depth + 1)))
    if spec.family == "qwen3_vl":  # a learned position embedding of 4 x 4 patches; the first block feeds deepstack
        text.update(head_dim=head_dim)
        text["rope_parameters"]["mrope_interleaved"] = True
        vision.update(num_position_embeddings=16, deepstack_visual_indexes=[0])
    config_class, model_class, _ = _classes(spec.family)
    config = config_class(
        text_config=text, vision_config=vision, image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END], tie_word_embeddings=False)
    torch.manual_seed(spec.seed)
    return model_class._from_config(config, dtype=torch.float32)


def write_tiny_vl_model(out_dir: str, spec: TinyVLSpec = TinyVLSpec()) -> str:
    """Write a randomly initialised tiny Qwen-VL model, its tokenizer and its processor to `out_dir`."""
    allow_qwen_vl_without_torchvision()
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = build_vl_tokenizer()
    model = build_vl_model(spec, tokenizer)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    pixels = (4 * patch_size(spec)) ** 2
    images = Qwen2VLImageProcessorPil(min_pixels=pixels, max_pixels=pixels, patch_size=patch_size(spec),
                                      temporal_patch_size=2, merge_size=2)
    *_, processor = _classes(spec.family)
    model.save_pretrained(out_dir)
    processor(image_processor=images, tokenizer=tokenizer, chat_template=VL_CHAT_TEMPLATE).save_pretrained(out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--family", choices=VL_FAMILIES, default="qwen2_vl")
    args = parser.parse_args()
    print(write_tiny_vl_model(args.out, TinyVLSpec(family=args.family)))


if __name__ == "__main__":
    main()
