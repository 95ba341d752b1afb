"""One rank of the training group: an FSDP2-sharded HF model, AdamW and its
schedule, inside a Ray actor. The driver calls its methods on every rank at
once (see `worker_group.TrainGroup`)."""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import ray
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import transformers
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import distribute_tensor
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from rlsys.algorithms.lm_loss import masked_nll_sum, token_logprobs
from rlsys.algorithms.rl_step import policy_step
from rlsys.config.schema import AlgorithmConfig, ModelConfig, OptimConfig
from rlsys.console import redirect_actor_output
from rlsys.data.batching import Batch, micro_batches
from rlsys.parallel.dims import ParallelDims
from rlsys.parallel.fsdp import apply_fsdp

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class TrainWorkerSpec:
    """Everything a rank needs to build its shard of the model and optimizer."""

    model: ModelConfig
    optim: OptimConfig
    dims: ParallelDims
    micro_batch_size: int
    total_steps: int
    seed: int
    num_threads: int
    use_gpu: bool
    mixed_precision: str = "auto"
    with_reference: bool = False
    """Also hold a frozen copy of the initial policy (for a KL penalty)."""
    collective_timeout_s: float = 600.0


def build_worker_spec(cfg, micro_batch_size: int, total_steps: int, with_reference: bool = False) -> TrainWorkerSpec:
    """The spec of a job config with model, optim, parallel, ray and seed sections (pretrain/SFT/RLVR)."""
    return TrainWorkerSpec(
        model=cfg.model,
        optim=cfg.optim,
        dims=ParallelDims(dp_replicate=cfg.parallel.dp_replicate, dp_shard=cfg.parallel.dp_shard),
        micro_batch_size=micro_batch_size,
        total_steps=total_steps,
        seed=cfg.seed,
        num_threads=cfg.ray.cpus_per_worker,
        use_gpu=cfg.ray.gpus_per_worker > 0,
        mixed_precision=cfg.parallel.mixed_precision,
        with_reference=with_reference,
        collective_timeout_s=cfg.train.collective_timeout_s,
    )


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to min_ratio at total_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class TrainWorker:
    def __init__(self, rank: int, spec: TrainWorkerSpec):
        redirect_actor_output()
        self.rank, self.spec = rank, spec
        torch.set_num_threads(spec.num_threads)
        transformers.utils.logging.disable_progress_bar()
        self.device = torch.device("cuda", 0) if spec.use_gpu else torch.device("cpu")

    def master_address(self) -> tuple[str, int]:
        """This node's address and a free port, for rank 0 to host the rendezvous."""
        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def setup(self, master_addr: str, master_port: int) -> None:
        spec = self.spec
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        if spec.use_gpu:
            torch.cuda.set_device(self.device)
        backend = "cpu:gloo,cuda:nccl" if spec.use_gpu else "gloo"
        dist.init_process_group(backend, rank=self.rank, world_size=spec.dims.world_size,
                                timeout=timedelta(seconds=spec.collective_timeout_s))
        self.mesh = spec.dims.build_mesh(self.device.type)
        torch.manual_seed(spec.seed)
        self.model = self._build_model()
        self.reference = self._build_model().eval().requires_grad_(False) if spec.with_reference else None
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=spec.optim.lr, betas=spec.optim.betas, eps=spec.optim.eps,
            weight_decay=spec.optim.weight_decay, foreach=True,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: lr_multiplier(step, spec.optim.warmup_steps, spec.total_steps, spec.optim.min_lr_ratio),
        )

    def _build_model(self) -> torch.nn.Module:
        spec = self.spec
        model = AutoModelForCausalLM.from_pretrained(spec.model.path, dtype=_DTYPES[spec.model.dtype])
        model.to(self.device)
        use_bf16 = spec.mixed_precision == "bf16" or (spec.mixed_precision == "auto" and spec.use_gpu)
        return apply_fsdp(model, spec.dims.fsdp_mesh(self.mesh), torch.bfloat16 if use_bf16 else None)

    # -- training -----------------------------------------------------------

    def forward_backward(self, shard: Batch, num_global_targets: int) -> float:
        """Accumulate gradients of (sum of target NLL) / num_global_targets over
        this rank's rows; returns this rank's share of the global mean loss."""
        self.model.train()
        total = 0.0
        for micro in micro_batches(shard, self.spec.micro_batch_size):
            micro = self._to_device(micro)
            logprobs = token_logprobs(self.model, micro["input_ids"], micro["attention_mask"])
            loss = masked_nll_sum(logprobs, micro["loss_mask"]) / num_global_targets
            loss.backward()
            total += loss.item()
        return total

    def train_step(self, shard: Batch, num_global_targets: int) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.forward_backward(shard, num_global_targets)
        grad_norm = self._clip_gradients()
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        return {"loss": loss, "grad_norm": grad_norm, "lr": lr}

    def compute_logprobs(self, shard: Batch, reference: bool = False) -> torch.Tensor:
        """Per-token log-probs [B, T] aligned with input_ids (column 0 is 0), without grad."""
        model = self.reference if reference else self.model
        out = torch.zeros(shard["input_ids"].shape, dtype=torch.float32)
        row = 0
        with torch.no_grad():
            for micro in micro_batches(shard, self.spec.micro_batch_size):
                micro = self._to_device(micro)
                logprobs = token_logprobs(model, micro["input_ids"], micro["attention_mask"])
                rows, length = logprobs.shape
                out[row:row + rows, 1:length + 1] = logprobs.cpu()
                row += rows
        model.reshard()  # FSDP2 keeps the root unsharded after a forward without backward
        return out

    def update_policy(self, shard: Batch, counts: dict[str, int], algo: AlgorithmConfig) -> dict[str, float]:
        """One optimizer step on this rank's rows of a mini-batch; metric sums are
        already divided by the global counts, so the driver adds them up."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums = dict.fromkeys(("actor/pg_loss", "actor/clip_frac", "actor/entropy", "actor/kl"), 0.0)
        for micro in micro_batches(shard, self.spec.micro_batch_size):
            micro = self._to_device(micro)
            for name, value in policy_step(self.model, micro, counts, algo).items():
                sums[name] += value
        sums["actor/grad_norm"] = self._clip_gradients()
        sums["actor/lr"] = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        return sums

    def perturb_parameters(self, scale: float, seed: int) -> None:
        """Add seeded noise to every parameter (tests use it to make the policy differ from the engines')."""
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                noise = torch.randn(p.shape, generator=generator) * scale
                p.add_(distribute_tensor(noise.to(p.device), p.device_mesh, p.placements))

    def parameter_nbytes(self) -> dict[str, int]:
        """Full (unsharded) size of each parameter, by HF name, in training order."""
        return {name: p.numel() * p.element_size() for name, p in self.model.named_parameters()}

    def gather_bucket(self, names: list[str]) -> dict[str, torch.Tensor] | None:
        """Full tensors of `names` (a collective: every rank calls it); rank 0 returns them."""
        self.model.reshard()
        params = dict(self.model.named_parameters())
        full = {name: params[name].full_tensor().detach().cpu() for name in names}
        return full if self.rank == 0 else None

    def _to_device(self, micro: Batch) -> Batch:
        return {k: v.to(self.device) for k, v in micro.items()}

    def _clip_gradients(self) -> float:
        max_norm = self.spec.optim.max_grad_norm or float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, foreach=True)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Unsharded gradients by parameter name (gathers: every rank must call)."""
        return {name: p.grad.full_tensor().cpu() for name, p in self.model.named_parameters()}

    def local_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape of this rank's shard of each parameter."""
        return {name: tuple(p.to_local().shape) for name, p in self.model.named_parameters()}

    # -- state --------------------------------------------------------------

    def save_checkpoint(self, path: str) -> None:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=os.path.join(path, "model_optim"))
        extra = {"scheduler": self.scheduler.state_dict(), "rng": torch.get_rng_state()}
        torch.save(extra, os.path.join(path, f"rank{self.rank}.pt"))

    def load_checkpoint(self, path: str) -> None:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=os.path.join(path, "model_optim"))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        extra = torch.load(os.path.join(path, f"rank{self.rank}.pt"), weights_only=False)
        self.scheduler.load_state_dict(extra["scheduler"])
        torch.set_rng_state(extra["rng"])

    def export_hf(self, out_dir: str) -> None:
        """Write a Hugging Face directory of the full model (gathers on every rank, rank 0 writes)."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.model, options=options)
        if self.rank == 0:
            src = self.spec.model.path
            config = AutoConfig.from_pretrained(src)
            with torch.device("meta"):
                skeleton = AutoModelForCausalLM.from_config(config)
            skeleton.save_pretrained(out_dir, state_dict=state)
            AutoTokenizer.from_pretrained(src).save_pretrained(out_dir)
            if os.path.isfile(os.path.join(src, "generation_config.json")):
                GenerationConfig.from_pretrained(src).save_pretrained(out_dir)
        dist.barrier()

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
