"""A vLLM engine inside the calling process (no engine subprocess), as a
rollout actor or the eval stage needs it."""

from __future__ import annotations

import os

import torch


def create_llm(model_path: str, kv_cache_gib: float, seed: int, tensor_parallel_size: int = 1,
               sleep_mode: bool = False):
    # In-process engine core: starts in seconds and lives inside a Ray actor.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm import LLM

    on_gpu = torch.cuda.is_available()
    return LLM(
        model=model_path,
        dtype="bfloat16" if on_gpu else "float32",
        enforce_eager=not on_gpu,
        kv_cache_memory_bytes=int(kv_cache_gib * 2**30),
        tensor_parallel_size=tensor_parallel_size,
        enable_sleep_mode=sleep_mode,
        seed=seed,
    )
