"""Where a stage runs: the training group's parallel layout and Ray's resources per worker.

Each field carries its documentation as an attribute docstring; docs/configuration.md's key tables
are generated from them (`python -m rlsys.config.docs`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic.dataclasses import dataclass

from rlsys.config.base import STRICT


@dataclass(config=STRICT)
class ParallelConfig:
    """The training group's layout: world size = dp_replicate x dp_shard x tp x pp x cp ranks."""

    dp_shard: int = Field(default=1, gt=0)
    """FSDP2 shard degree (ranks that split each parameter)."""
    dp_replicate: int = Field(default=1, gt=0)
    """Replica groups of the sharded model (HSDP when both are > 1)."""
    tp: int = Field(default=1, gt=0)
    """Tensor-parallel degree: attention heads, MLP columns and the vocabulary split across this many ranks."""
    pp: int = Field(default=1, gt=0)
    """Pipeline-parallel ranks: the decoder layers split into consecutive stages."""
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"
    """With pp > 1: all forwards then all backwards (gpipe), one forward one backward (1f1b), or 1f1b
    over several smaller stages per rank (interleaved_1f1b), which shrinks the pipeline bubble."""
    pp_microbatches: int = Field(default=4, gt=0)
    """With pp > 1: micro-batches each data-parallel shard is split into (replaces train.micro_batch_size;
    with train.micro_batch_tokens, the fewest); at least pp for 1f1b; a multiple of pp for interleaved_1f1b."""
    pp_stages_per_rank: int = Field(default=2, gt=1)
    """With interleaved_1f1b: stages each pipeline rank holds (rank r runs stages r, r + pp, ...)."""
    ep: int = Field(default=1, gt=0)
    """Expert-parallel ranks: each MoE layer's experts split over this many of the dp_shard x cp x tp
    ranks, tokens sent to their experts with an all-to-all (not a dimension of the world size)."""
    cp: int = Field(default=1, gt=0)
    """Context-parallel ranks: each holds a contiguous chunk of every sequence (Ulysses all-to-all attention)."""
    sequence_parallel: bool = False
    """With tp > 1: norms and residual activations split along the sequence between the tp ranks."""
    loss_parallel: bool = False
    """With tp > 1: log-probs from the vocabulary-sharded LM head without gathering the logits."""
    activation_checkpointing: bool = False
    """Recompute each decoder block's activations in the backward pass instead of keeping them."""
    offload: bool = False
    """Keep parameters, gradients and optimizer state in host memory (FSDP2's CPUOffloadPolicy, pinned): each
    unit's weights are copied to the GPU for its forward and backward, its gradients back, and the optimizer
    steps on the host. For the policy, the reference and the critic alike. On a CPU run everything is already
    in host memory: the policy runs with nothing to move."""
    pack_sequences: bool = True
    """Lay the sequences of each micro-batch end to end in as few rows as they fit, each attending to
    its own tokens only (span by span, no mask of the row's width), so no compute goes to padding
    (VeRL's use_remove_padding). For models with causal attention, full or sliding-window (vision-language
    ones with their pictures), not under pp. A loss read
    per sequence (GSPO, seq-mean-token-mean, a sequence-level rollout_correction, the critic's, a
    reward model's Bradley-Terry loss) gets the packed forward's logits laid back out as rows (so not
    under cp)."""
    share_prompts: bool = True
    """With pack_sequences: rows that begin alike (a GRPO group's prompt, a system prompt, the history an
    episode's segments repeat, an earlier segment's trained turns included) share one copy of what they
    repeat, as a tree, in the forward and backward pass (unless that lays out more cells, padding
    included, than unshared); two rows that both train a token keep a copy each. The gradient is the same."""
    mixed_precision: Literal["auto", "none", "bf16"] = "auto"
    """FSDP2 mixed precision: auto is bf16 compute with fp32 reduction on GPU, full fp32 on CPU."""

    def __post_init__(self) -> None:
        """A pipeline's micro-batches fit its schedule; the tensor-parallel options need tensor parallelism."""
        if self.pp > 1 and self.pp_schedule == "1f1b" and self.pp_microbatches < self.pp:
            raise ValueError(f"pp_microbatches: 1f1b needs at least pp ({self.pp}) micro-batches, got "
                             f"{self.pp_microbatches}")
        if self.pp > 1 and self.pp_schedule == "interleaved_1f1b" and self.pp_microbatches % self.pp:
            raise ValueError(f"pp_microbatches: interleaved_1f1b needs a multiple of pp ({self.pp}), got "
                             f"{self.pp_microbatches}")
        option = next((key for key in ("sequence_parallel", "loss_parallel") if getattr(self, key)), None)
        if self.tp == 1 and option:
            raise ValueError(f"{option}: needs parallel.tp > 1")

    @property
    def world_size(self) -> int:
        """Training ranks the layout takes."""
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp


@dataclass(config=STRICT)
class RayConfig:
    cpus_per_worker: int | None = Field(default=None, gt=0)
    """CPUs reserved for each training rank (also its torch thread count). Unset: this machine's cores
    (at most ray.num_cpus) less separate rollout engines' CPUs, split evenly over the ranks; 1 when joining
    RAY_ADDRESS."""
    gpus_per_worker: float | None = Field(default=None, ge=0)
    """GPUs for each training rank: 0 trains on CPU with gloo, 1 on its own GPU with nccl (a rank
    drives one GPU; colocated engines share it). Empty: 1 when the Ray cluster has a GPU for every
    rank, else 0 (a run on CPU beside a cluster's GPUs says so before it starts)."""
    num_cpus: int | None = Field(default=None, gt=0)
    """Logical CPUs of a local cluster (default: this machine's cores). More than the cores lets a
    layout with more ranks than cores run, slowly; ignored when joining RAY_ADDRESS."""
    num_gpus: int | None = Field(default=None, ge=0)
    """GPUs of a local cluster (default: the GPUs this machine's CUDA sees, or Ray's
    RAY_OVERRIDE_RESOURCES); ignored when joining RAY_ADDRESS."""
    include_dashboard: bool = True
    """Start the Ray dashboard with a local cluster (ignored when joining RAY_ADDRESS)."""
    dashboard_host: str = "127.0.0.1"
    """Interface the local dashboard listens on."""
