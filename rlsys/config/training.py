"""Training sections every training stage has: data, optimizer, the step loop, tracking.

Each field carries its documentation as an attribute docstring; docs/configuration.md's key tables
are generated from them (`python -m rlsys.config.docs`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic.dataclasses import dataclass

from rlsys.config.base import STRICT


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
    tools_key: str = "tools"
    """SFT: a column of OpenAI function schemas a chat row's template renders (`tools=`), as the agent loop
    renders them into its prompts."""
    chosen_key: str = "chosen"
    """Reward-model training (`rm`): the preferred response's column (a string), beside `prompt_key`."""
    rejected_key: str = "rejected"
    """Reward-model training (`rm`): the other response's column (a string)."""
    val_files: list[str] = Field(default_factory=list)
    """Reward-model training (`rm`): held-out preference pairs, scored before training, every
    `train.val_every` steps and at the end (`val/rm_accuracy`, `val/loss`, `val/rm_margin`)."""


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
class LoopConfig:
    """What every training loop has: checkpoints, resume, and what to do when a worker fails."""

    save_every: int = Field(default=0, ge=0)
    """Checkpoint period in steps (0: only at the end)."""
    keep_last: int = Field(default=2, gt=0)
    """Checkpoints kept on disk; older ones are deleted."""
    resume: bool = True
    """Resume from the newest complete checkpoint in output_dir/checkpoints when there is one."""
    max_restarts: int = Field(default=0, ge=0)
    """When a worker dies or a collective times out: rebuild the groups and resume from the newest
    checkpoint inside the same command, up to this many times (0: stop with exit code 3)."""
    max_worker_restarts: int = Field(default=3, ge=0)
    """RL: a rollout engine, reward worker or served-model engine (reward model, judge, teacher)
    that dies is replaced alone, in its place, the current weights synced into it, its unfinished
    requests sent again; the trainer keeps its state and no checkpoint is read. Up to this many in
    an attempt (a restart from a checkpoint counts afresh); past them the run ends (or restarts,
    `max_restarts`) as for a dead training rank."""
    collective_timeout_s: float = Field(default=600.0, gt=0)
    """A collective (all-reduce, all-gather ...) that waits longer than this, or a rank that answers
    this long after its peers, fails the step as a dead peer would."""
    log_every: int = Field(default=1, gt=0)
    """Console progress-bar refresh period in steps (metrics.jsonl gets every step)."""


@dataclass(config=STRICT)
class TrainConfig(LoopConfig):
    steps: int = Field(default=100, gt=0)
    """Optimizer steps to run."""
    global_batch_size: int = Field(default=64, gt=0)
    """Sequences per optimizer step; must equal micro_batch_size x grad-accumulation x data-parallel size."""
    micro_batch_size: int = Field(default=16, gt=0)
    """Sequences per forward/backward on one rank."""
    micro_batch_tokens: int | None = Field(default=None, gt=0)
    """Tokens per forward/backward on one rank, in place of micro_batch_size (VeRL's use_dynamic_bsz
    with ppo_max_token_len_per_gpu): consecutive sequences up to this many tokens; one longer goes alone.
    Under context parallel, each rank's share of the sequences. Under pipeline parallel, the number of
    equal micro-batches each shard is split into: as many as the budget needs, at least
    parallel.pp_microbatches."""
    val_every: int = Field(default=0, ge=0)
    """Reward-model training (`rm`): score `data.val_files` every N steps (0: before and after training only)."""


@dataclass(config=STRICT)
class TrackingConfig:
    backends: list[Literal["console", "jsonl", "wandb", "tensorboard", "mlflow", "ray"]] = Field(
        default_factory=lambda: ["console", "jsonl", "ray"]
    )
    """Where metrics go, all under the same names; metrics.jsonl is always written. `ray` exports
    them as Ray metrics `rlsys_<name>` for the dashboard and Prometheus."""
    project: str = "rlsys"
    """wandb project / mlflow experiment name."""
    run_name: str = ""
    """Run name for wandb/tensorboard (default: the output directory's name)."""
    wandb_mode: Literal["auto", "offline", "online"] = "auto"
    """auto: WANDB_MODE when set, else online when wandb has an API key (WANDB_API_KEY, or `wandb login`'s
    entry in ~/.netrc) and offline without one; offline runs can be synced later with `wandb sync`."""
    entity: str = ""
    """wandb entity (team or user) the run goes to (default: the API key's own)."""
    tags: list[str] = Field(default_factory=list)
    """wandb tags of the run."""
    group: str = ""
    """wandb group the run belongs to (e.g. the runs of one sweep or one pipeline)."""
    mlflow_uri: str = ""
    """mlflow tracking URI (default: a local SQLite store, output_dir/mlflow.db)."""
    log_samples_every: int = Field(default=-1, ge=-1)
    """RL: write what the model said (prompt, response, reward and each term, advantage, length, turns) every
    N steps to samples.jsonl, a wandb Table, TensorBoard text and an mlflow table; -1: at each validation step
    (`train.val_every` and the last step), 0: never. TRL's `log_completions`, VeRL's `rollout_data_dir`."""
    samples_per_log: int = Field(default=8, gt=0)
    """RL: how many of the step's responses are written, its first prompts' groups in order."""
    trace: bool = True
    """Write the run's timeline to trace.json (Chrome trace events; open in ui.perfetto.dev): each step's
    phases in the driver, every training rank's forward, backward and optimizer step, and every actor's
    calls as Ray recorded them (docs/operations.md)."""
