"""The sequence length a vLLM engine is built for, and whether its KV cache holds one such sequence.

vLLM builds an engine for `max_model_len` tokens, the model's whole context unless told otherwise,
and refuses to start when one sequence of that length needs more KV cache than the engine was
given; the refusal reaches only the engine's log. A run's sequences are never longer than its
longest prompt plus its response budget (VeRL sets max_model_len the same way), which for a
short-answer job on a model of 8 k or 128 k positions is a small part of the context; so an
engine is built for that, and a budget that cannot hold it is refused before anything starts.
"""

from __future__ import annotations

from collections.abc import Iterable

from rlsys.config.loader import ConfigError
from rlsys.config.rollout import CPU_ENGINE_MEMORY_GIB

BOUNDED_LOOPS = ("single_turn", "tool")
"""The agent loops that keep a trajectory within its prompt and response budget. Others (the openai
loop, whose harness writes the requests; a loop of the user's) leave their engines the model's context."""
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_SMALLEST_BLOCK = 16
"""The block size the KV estimate rounds to when vLLM picks one: never more than vLLM counts."""


def run_length(prompt_lengths: Iterable[int], response_tokens: int, loop: str) -> int | None:
    """The longest sequence of a run: its longest prompt plus a whole response's budget (None for a
    loop not known to keep within them: its engine keeps the model's context)."""
    if loop not in BOUNDED_LOOPS:
        return None
    return max(prompt_lengths, default=0) + response_tokens


def check_kv_budget(model_path: str, length: int | None, memory_gib: float | None, dtype: str, on_gpu: bool,
                    block_size: int | None, memory_key: str, length_key: str, tensor_parallel_size: int = 1) -> None:
    """Refuse, naming `memory_key` and `length_key` (what shortens the sequence), an engine whose KV
    cache (`memory_gib` for each of its `tensor_parallel_size` ranks, which split the key/value heads)
    cannot hold one sequence of `length` tokens (None: the model's context), as vLLM would refuse it at
    start. Only models whose every layer attends over the whole sequence are judged here; vLLM judges
    the others (sliding windows, linear or latent attention), and a GPU engine sized by its share of
    the device (`memory_gib` None), which the driver cannot see."""
    from transformers import AutoConfig

    if memory_gib is None:
        if on_gpu:
            return
        memory_gib = CPU_ENGINE_MEMORY_GIB

    text = AutoConfig.from_pretrained(model_path).get_text_config()
    if not _full_attention(text):
        return
    tokens = length or getattr(text, "max_position_embeddings", 0)
    dtype = dtype if dtype != "auto" else "bfloat16" if on_gpu else "float32"
    block = block_size or _SMALLEST_BLOCK
    needed = -(-tokens // block) * block * kv_bytes_per_token(text, _BYTES.get(dtype, 2)) // tensor_parallel_size
    if needed > memory_gib * 2**30:
        what = f"{tokens} tokens" if length else f"the model's context ({tokens} tokens)"
        remedy = f"lower {length_key}" if length else f"set {length_key}"
        raise ConfigError(f"{memory_key}: one sequence of {what} needs {needed / 2**30:.3g} GiB of KV cache in "
                          f"the engine, more than its {memory_gib:g} GiB; raise {memory_key} or {remedy}")


def kv_bytes_per_token(text_config, dtype_bytes: int) -> int:
    """K and V for every layer and key/value head of one token."""
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    return 2 * text_config.num_hidden_layers * kv_heads * head_dim * dtype_bytes


def _full_attention(text_config) -> bool:
    layer_types = getattr(text_config, "layer_types", None) or []
    windowed = getattr(text_config, "sliding_window", None) and getattr(text_config, "use_sliding_window", True)
    latent = hasattr(text_config, "kv_lora_rank")
    return all(kind == "full_attention" for kind in layer_types) and not windowed and not latent
