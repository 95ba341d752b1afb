"""A vLLM engine inside the calling process (no engine subprocess), as a
rollout actor, the eval stage or a frozen model's actor needs it."""

from __future__ import annotations

import gc
import os
from typing import TYPE_CHECKING

import torch

from rlsys.config.loader import ConfigError
from rlsys.config.rollout import CPU_ENGINE_MEMORY_GIB
from rlsys.host_memory import release_freed_memory
from rlsys.models.vision import engine_image_limits
from rlsys.rollout.vllm_compat import routing_runner_env

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from rlsys.config.rollout import RolloutConfig, ServingConfig


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The adapter ranks a vLLM engine can be built for (`max_lora_rank`)."""


def create_llm(model_path: str, cfg: RolloutConfig, seed: int, sleep_mode: bool = False, lora_rank: int = 0,
               fp32_head: bool = False, return_routing: bool = False):
    """`lora_rank`: serve LoRA adapters up to this rank (0: none); `fp32_head`: logits computed in fp32
    from the bf16 hidden states and weights, as the trainer's with `model.fp32_lm_head`; `return_routing`:
    each completion carries the experts an MoE model routed its tokens to (`routed_experts`, for R3).
    `rollout.engine_kwargs` go to vLLM last and override the rest."""
    dtype = prepare_engine(cfg.dtype)
    from transformers import AutoConfig
    from vllm import LLM

    on_gpu = torch.cuda.is_available()
    if return_routing:
        routing_runner_env()
    images = engine_image_limits(AutoConfig.from_pretrained(
        model_path, trust_remote_code=cfg.engine_kwargs.get("trust_remote_code", False)))
    return LLM(
        model=model_path,
        dtype=dtype,
        enforce_eager=not on_gpu,
        **engine_memory(cfg.engine_memory_gib, cfg.gpu_memory_utilization, on_gpu),
        max_model_len=cfg.max_model_len,
        block_size=cfg.block_size,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        # vLLM rewinds a seeded sampler after a partial prefill by a CUDA generator offset; on CPU that
        # raises "CPU Generator does not use offset", so there every prompt is prefilled in one pass
        enable_chunked_prefill=on_gpu,
        tensor_parallel_size=cfg.tensor_parallel_size,
        distributed_executor_backend=executor_backend(cfg.tensor_parallel_size),
        enable_sleep_mode=sleep_mode,
        # log-probs of the distribution sampled from (after temperature), which the trainer reproduces
        logprobs_mode="processed_logprobs",
        **({"hf_overrides": {"head_dtype": "float32"}} if fp32_head and dtype != "float32" else {}),
        seed=seed,
        **({"enable_lora": True, "max_loras": 1, "max_lora_rank": min(r for r in LORA_RANKS if r >= lora_rank)}
           if lora_rank else {}),
        **({"enable_return_routed_experts": True} if return_routing else {}),
        **{**images, **cfg.engine_kwargs},  # the user's limit_mm_per_prompt over the default
    )


def create_served_llm(model_path: str, cfg: ServingConfig, seed: int, pooling: bool):
    """An engine of a frozen model (`rlsys.actors.served_models`): a reward model's pooling runner
    (`pooling`), or a causal LM for a judge's verdicts and a teacher's prompt log-probs."""
    dtype = prepare_engine(cfg.dtype)
    from vllm import LLM

    on_gpu = torch.cuda.is_available()
    return LLM(
        model=model_path,
        runner="pooling" if pooling else "generate",
        dtype=dtype,
        enforce_eager=not on_gpu,
        **engine_memory(cfg.engine_memory_gib, None, on_gpu),
        max_model_len=cfg.max_model_len,
        enable_chunked_prefill=on_gpu,  # as create_llm: seeded CPU samplers cannot rewind a partial prefill
        tensor_parallel_size=cfg.tensor_parallel_size,
        distributed_executor_backend=executor_backend(cfg.tensor_parallel_size),
        seed=seed,
    )


def executor_backend(tensor_parallel_size: int) -> str | None:
    """Where a tensor-parallel engine's ranks run: as Ray actors in the bundles its placement named
    (`VLLM_RAY_BUNDLE_INDICES`: an engine colocated on the training ranks' GPUs), else as worker
    processes of this one, on the devices this actor was given (an engine's own bundle, or CPU).
    Never vLLM's own choice: inside a placement group it would pick Ray and ask the group for GPUs
    that the engine's bundle already holds, waiting for them without end."""
    if tensor_parallel_size == 1:
        return None
    return "ray" if os.environ.get("VLLM_RAY_BUNDLE_INDICES") else "mp"


def stop_engine(llm) -> None:
    """Shut an in-process engine down: with tensor-parallel workers its executor unlinks their
    shared-memory queues (a killed actor leaves them in /dev/shm); it also tears down vLLM's
    process-wide parallel state, which the process's next engine sets up again."""
    llm.llm_engine.engine_core.shutdown()


def free_stopped_engine() -> None:
    """After `stop_engine` and dropping every reference to the engine: give its memory back (its
    weights and KV cache), so that the process can hold the next engine."""
    gc.collect()
    release_freed_memory(0)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def prepare_engine(dtype: str) -> str:
    """Set this process up for an engine: vLLM's engine core runs in it (it starts in seconds and lives
    inside a Ray actor), fp32 stays exact on GPU. Returns the dtype (auto: bfloat16 on GPU, float32 on CPU)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    on_gpu = torch.cuda.is_available()
    dtype = resolved_dtype(dtype, on_gpu)
    if on_gpu and dtype == "float32":
        # Triton multiplies fp32 matrices in TF32 unless told otherwise, and vLLM's Triton attention
        # kernels (FlashAttention has no fp32) take that default: an fp32 engine would then sample
        # from log-probs ~1e-3 away from the trainer's fp32 ones
        os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
    return dtype


def resolved_dtype(dtype: str, on_gpu: bool) -> str:
    """`rollout.dtype` as the engine takes it: auto is bfloat16 on a GPU, float32 on CPU."""
    return dtype if dtype != "auto" else "bfloat16" if on_gpu else "float32"


def synced_weight_dtype(dtype: str, on_gpu: bool, fp32_head: bool) -> torch.dtype | None:
    """The dtype a sync that casts (`rlsys.sync.gathered`) sends an engine's weights in: the engine's, or
    None (the trainer's own) where the engine keeps some weights in fp32 (its LM head, `model.fp32_lm_head`)."""
    return None if fp32_head else getattr(torch, resolved_dtype(dtype, on_gpu))


def engine_memory(kv_gib: float | None, gpu_share: float | None, on_gpu: bool) -> dict:
    """vLLM's memory arguments: a KV cache of `kv_gib` GiB; else, on a GPU, `gpu_share` of the device for
    the engine's weights, activations and KV cache (vLLM sizes the cache from what is left), at most what
    is free now (`free_memory_fraction`)."""
    if not on_gpu:
        return {"kv_cache_memory_bytes": int((kv_gib or CPU_ENGINE_MEMORY_GIB) * 2**30)}
    if kv_gib is None:
        return {"gpu_memory_utilization": min(gpu_share, free_memory_fraction())}
    return {"kv_cache_memory_bytes": int(kv_gib * 2**30), "gpu_memory_utilization": free_memory_fraction()}


def free_memory_fraction() -> float:
    """vLLM refuses to start unless `gpu_memory_utilization` x the device's memory is free, even
    when `kv_cache_memory_bytes` alone sizes its KV cache. A colocated engine starts beside training
    ranks (or another engine) that already hold memory, so it asks for no more than is free now: on
    its GPU, or, for an engine whose tensor-parallel workers start in the training ranks' bundles
    (`VLLM_RAY_BUNDLE_INDICES`) and which holds no GPU itself, the least free of its node's GPUs,
    read through NVML (a CUDA call would open a context on the node's first GPU)."""
    if os.environ.get("VLLM_RAY_BUNDLE_INDICES"):
        share = least_free_share_of_node_gpus()
    else:
        free, total = torch.cuda.mem_get_info()
        share = free / total
    return max(0.01, min(0.9, share - 0.01))


def least_free_share_of_node_gpus() -> float:
    from vllm.third_party import pynvml

    pynvml.nvmlInit()
    try:
        shares = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            memory = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index))
            shares.append(memory.free / memory.total)
        return min(shares)
    finally:
        pynvml.nvmlShutdown()


def set_engine_threads(num_threads: int, tensor_parallel_size: int) -> None:
    """Size this actor's torch threads and, on CPU, bind the engine's tensor-parallel ranks to cores."""
    torch.set_num_threads(num_threads)
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_thread_binding(num_threads, tensor_parallel_size))


def cpu_thread_binding(num_threads: int, tensor_parallel_size: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for an engine on CPU. One rank keeps torch's own threads
    ("nobind"). Tensor-parallel ranks each need a core list: vLLM's automatic binding wants a
    NUMA node per rank, which a laptop or a small VM does not have. Here this process's
    allowed cores are split evenly between the ranks ("0|1" for 2 ranks on 2 cores)."""
    if tensor_parallel_size == 1:
        return "nobind"
    cores = sorted(os.sched_getaffinity(0))
    per_rank = max(1, min(num_threads, len(cores)) // tensor_parallel_size)
    return "|".join(",".join(str(cores[(rank * per_rank + i) % len(cores)]) for i in range(per_rank))
                    for rank in range(tensor_parallel_size))


def check_heads_split(model_config: PretrainedConfig, degree: int, key: str) -> None:
    """Tensor parallelism splits attention heads (and key/value heads) evenly across ranks."""
    heads = getattr(model_config, "num_attention_heads", None)
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    if heads and degree > 1 and (heads % degree or (kv_heads % degree and degree % kv_heads)):
        raise ConfigError(f"{key}: {degree} does not split the model's {heads} attention heads "
                          f"({kv_heads} key/value heads) evenly")


def check_block_size(block_size: int | None, on_gpu: bool) -> None:
    """vLLM's CPU attention takes KV blocks of a multiple of 32 tokens."""
    if block_size is not None and not on_gpu and block_size % 32:
        raise ConfigError(f"rollout.block_size: {block_size} tokens; on CPU a multiple of 32")
