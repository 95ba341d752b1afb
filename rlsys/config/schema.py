"""Typed configuration for every stage.

Each dataclass field carries its documentation as an attribute docstring; the
README's key tables are generated from them (`python -m rlsys.config.docs`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass

STRICT = ConfigDict(extra="forbid", use_attribute_docstrings=True)


@dataclass(config=STRICT)
class ModelConfig:
    path: str = ""
    """Local Hugging Face causal-LM directory (config.json, safetensors, tokenizer files)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype the trainer keeps parameters in; bf16 compute on GPU comes from `parallel.mixed_precision`."""


@dataclass(config=STRICT)
class DataConfig:
    train_files: list[str] = Field(default_factory=list)
    """JSONL or Parquet files for training, read with `datasets`."""
    max_seq_len: int = Field(default=128, gt=1)
    """Tokens per packed pretraining sequence; SFT examples longer than this are dropped and counted."""
    text_key: str = "text"
    """Pretraining: the column holding a document."""
    prompt_key: str = "prompt"
    """SFT: the prompt column (a string, or a chat list of {role, content})."""
    response_key: str = "response"
    """SFT: the response column (a string)."""
    messages_key: str = "messages"
    """SFT: a chat column used instead of prompt/response; loss falls on assistant turns."""


@dataclass(config=STRICT)
class OptimConfig:
    lr: float = Field(default=1e-3, gt=0)
    """Peak learning rate of AdamW."""
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    """Cosine decay ends at lr * min_lr_ratio."""
    warmup_steps: int = Field(default=0, ge=0)
    """Linear warmup steps before the cosine decay."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    eps: float = Field(default=1e-8, gt=0)
    """AdamW epsilon."""
    max_grad_norm: float = Field(default=1.0, ge=0)
    """Clip the global gradient norm to this value (0 disables clipping)."""


@dataclass(config=STRICT)
class TrainConfig:
    steps: int = Field(default=100, gt=0)
    """Optimizer steps to run."""
    global_batch_size: int = Field(default=64, gt=0)
    """Sequences per optimizer step; must equal micro_batch_size x grad-accumulation x data-parallel size."""
    micro_batch_size: int = Field(default=16, gt=0)
    """Sequences per forward/backward on one rank."""
    log_every: int = Field(default=1, gt=0)
    """Console progress-bar refresh period in steps (metrics.jsonl gets every step)."""
    save_every: int = Field(default=0, ge=0)
    """Checkpoint period in steps (0: only at the end)."""
    keep_last: int = Field(default=2, gt=0)
    """Checkpoints kept on disk; older ones are deleted."""
    resume: bool = True
    """Resume from the newest complete checkpoint in output_dir/checkpoints when there is one."""


@dataclass(config=STRICT)
class ParallelConfig:
    dp_shard: int = Field(default=1, gt=0)
    """FSDP2 shard degree (ranks that split each parameter)."""
    dp_replicate: int = Field(default=1, gt=0)
    """Replica groups of the sharded model (HSDP when both are > 1)."""
    mixed_precision: Literal["auto", "none", "bf16"] = "auto"
    """FSDP2 mixed precision: auto is bf16 compute with fp32 reduction on GPU, full fp32 on CPU."""


@dataclass(config=STRICT)
class RayConfig:
    cpus_per_worker: int = Field(default=1, gt=0)
    """CPUs reserved for each training rank (also its torch thread count)."""
    gpus_per_worker: float = Field(default=0.0, ge=0)
    """GPUs for each training rank; 0 trains on CPU with gloo, >0 on CUDA with nccl."""
    include_dashboard: bool = True
    """Start the Ray dashboard with a local cluster (ignored when joining RAY_ADDRESS)."""
    dashboard_host: str = "127.0.0.1"
    """Interface the local dashboard listens on."""


@dataclass(config=STRICT)
class TrackingConfig:
    backends: list[Literal["console", "jsonl", "wandb", "tensorboard"]] = Field(
        default_factory=lambda: ["console", "jsonl"]
    )
    """Where metrics go; metrics.jsonl is always written."""
    project: str = "rlsys"
    """wandb project name."""
    run_name: str = ""
    """Run name for wandb/tensorboard (default: the output directory's name)."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """wandb mode; offline runs can be synced later with `wandb sync`."""


@dataclass(config=STRICT)
class EvalConfig:
    files: list[str] = Field(default_factory=list)
    """Test split in the RL schema (data_source, prompt, reward_model.ground_truth)."""
    reward: str = "arith"
    """Registered reward that judges each response (1 = correct)."""
    max_new_tokens: int = Field(default=16, gt=0)
    """Generation budget per prompt."""
    temperature: float = Field(default=0.0, ge=0)
    """Sampling temperature (0 is greedy)."""
    limit: int = Field(default=0, ge=0)
    """Evaluate only the first N rows (0: all)."""
    engine_memory_gib: float = Field(default=0.5, gt=0)
    """KV-cache memory for the vLLM engine, in GiB."""


@dataclass(config=STRICT)
class JobConfig:
    """What every stage has: where it writes, its seed, and the model it starts from."""

    output_dir: str = ""
    """Run directory: resolved config, metrics.jsonl, summary.json, checkpoints/, hf_model/, eval results."""
    seed: int = 0
    """Seed for data order, sampling and any randomness on the ranks."""
    model: ModelConfig = Field(default_factory=ModelConfig)


@dataclass(config=STRICT)
class TrainJobConfig(JobConfig):
    """`pretrain` and `sft`: the training group without the rollout group."""

    data: DataConfig = Field(default_factory=DataConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    eval: EvalConfig | None = None
    """Optional: evaluate the final model on this split after training."""


@dataclass(config=STRICT)
class EvalJobConfig(JobConfig):
    """`eval`: generate on a test split with vLLM and score with a reward."""

    eval: EvalConfig = Field(default_factory=EvalConfig)
