"""Which positions a model's attention layers see: all before a token (full causal attention), or
only those within a sliding window (Mistral's every layer, Qwen2's past `max_window_layers`, Gemma's
alternate ones), as its transformers config says."""

from __future__ import annotations

from transformers import PretrainedConfig


def has_sliding_window(config: PretrainedConfig) -> bool:
    """Whether some layer of a model with `config` attends within a sliding window: it has a window,
    does not turn it off (`use_sliding_window`), and names no layer kinds or a sliding one."""
    kinds = getattr(config, "layer_types", None)
    return bool(getattr(config, "sliding_window", None)) and getattr(config, "use_sliding_window", True) is not False \
        and (kinds is None or "sliding_attention" in kinds)
