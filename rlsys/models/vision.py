"""Which models are vision-language models, and what their engines are told about images."""

from __future__ import annotations

IMAGES_PER_PROMPT = 4
"""The pictures a prompt may hold, by default (`rollout.engine_kwargs.limit_mm_per_prompt` sets it)."""


def is_vision_language(config) -> bool:
    """A model with a vision tower (Qwen2-VL's family: its config has a `vision_config`)."""
    return getattr(config, "vision_config", None) is not None


def engine_image_limits(config) -> dict:
    """vLLM's `limit_mm_per_prompt` for the model: images (videos need torchvision and are refused); none
    for a text model."""
    return {"limit_mm_per_prompt": {"image": IMAGES_PER_PROMPT, "video": 0}} if is_vision_language(config) else {}
