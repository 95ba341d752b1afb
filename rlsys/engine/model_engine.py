"""The model engine: one rank's share of a model in its parallel layout, with
its optimizer and schedule. It knows nothing of Ray or of RL: a Ray worker
holds one engine per role (the policy, a frozen reference) and hands it loss
functions (`rlsys.algorithms`).

A loss function is pure: `loss_fn(logits, micro_batch) -> LossOutput`, its
loss already divided by GLOBAL counts (all data-parallel ranks, all
micro-batches), so summed gradients are the single-process gradient in any
layout, and its metric sums add up across data-parallel ranks the same way.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from rlsys.algorithms.lm_loss import LossOutput
from rlsys.config.schema import ModelConfig, OptimConfig, ParallelConfig
from rlsys.data.batching import Batch, micro_batches
from rlsys.engine.loading import load_parallel_model
from rlsys.parallel.dims import ParallelDims

LossFn = Callable[[torch.Tensor, Batch], LossOutput]


@dataclass(frozen=True)
class EngineSpec:
    model: ModelConfig
    optim: OptimConfig
    dims: ParallelDims
    parallel: ParallelConfig
    micro_batch_size: int
    total_steps: int
    param_dtype: torch.dtype | None
    """Compute dtype under FSDP2 mixed precision (None: the model's own)."""


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to min_ratio at total_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class ModelEngine:
    def __init__(self, spec: EngineSpec, mesh: DeviceMesh, device: torch.device, trainable: bool = True):
        self.spec, self.mesh, self.device = spec, mesh, device
        self.model = load_parallel_model(spec.model, spec.dims, mesh, spec.parallel, device, spec.param_dtype)
        self.dp_group = mesh["dp"].get_group()
        self.sequence_multiple = spec.dims.tp if spec.parallel.sequence_parallel else 1
        self.optimizer = self.scheduler = None
        if trainable:
            self._build_optimizer()
        else:
            self.model.eval().requires_grad_(False)

    def _build_optimizer(self) -> None:
        optim = self.spec.optim
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=optim.lr, betas=optim.betas, eps=optim.eps,
                                           weight_decay=optim.weight_decay, fused=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: lr_multiplier(step, optim.warmup_steps, self.spec.total_steps, optim.min_lr_ratio))

    # -- compute --------------------------------------------------------------

    def forward_backward(self, shard: Batch, loss_fn: LossFn, forward_only: bool = False
                         ) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        """Run `loss_fn` on every micro-batch of this rank's `shard` (and backward unless
        `forward_only`). Returns the metric sums, added up over the data-parallel ranks, and
        the per-row outputs of this shard, [rows, T] like its input_ids."""
        self.model.train(not forward_only and self.optimizer is not None)
        sums: dict[str, torch.Tensor] = {}
        rows: dict[str, list[torch.Tensor]] = {}
        grad = torch.no_grad() if forward_only else contextlib.nullcontext()
        with grad, self._loss_context():
            for micro in micro_batches(shard, self.spec.micro_batch_size):
                out = loss_fn(self._forward(micro), micro)
                if not forward_only:
                    out.loss.backward()
                for name, value in out.metrics.items():
                    sums[name] = sums.get(name, 0.0) + value.detach().float()
                for name, value in out.rows.items():  # micro-batches are trimmed: pad back to the shard's width
                    width = shard["input_ids"].shape[1] - value.shape[1]
                    rows.setdefault(name, []).append(F.pad(value.detach().cpu(), (0, width)))
        if forward_only:
            self.model.reshard()  # FSDP2 keeps the root unsharded after a forward without backward
        return self._sum_over_dp(sums), {name: torch.cat(parts) for name, parts in rows.items()}

    def _forward(self, micro: Batch) -> torch.Tensor:
        """Logits of one micro-batch, [rows, T, vocab] (vocabulary-sharded DTensor under loss parallel)."""
        micro = {k: v.to(self.device) for k, v in micro.items()}
        length = micro["input_ids"].shape[1]
        if self.sequence_multiple == 1:
            return self.model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"],
                              use_cache=False).logits
        # sequence parallel splits the sequence evenly, and HF would build masks and positions
        # at the local length: pad to a multiple of tp and pass both prepared at full length
        padded = -length % self.sequence_multiple
        ids = F.pad(micro["input_ids"], (0, padded))
        mask = F.pad(micro["attention_mask"], (0, padded))
        logits = self.model(input_ids=ids, attention_mask=_causal_mask(mask),
                            position_ids=torch.arange(ids.shape[1], device=ids.device).expand_as(ids),
                            use_cache=False).logits
        return logits[:, :length]

    def _loss_context(self):
        return loss_parallel() if self.spec.parallel.loss_parallel else contextlib.nullcontext()

    def _sum_over_dp(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        if not sums:
            return {}
        stacked = torch.stack([torch.as_tensor(v, device=self.device) for v in sums.values()])
        dist.all_reduce(stacked, group=self.dp_group)
        return dict(zip(sums, stacked.tolist()))

    def optimizer_step(self) -> dict[str, float]:
        grad_norm = clip_grad_norm(self.model, self.spec.optim.max_grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": grad_norm, "lr": lr}

    # -- weights --------------------------------------------------------------

    def parameter_nbytes(self) -> dict[str, int]:
        """Full (unsharded) size of each parameter, by HF name, in module order."""
        return {name: p.numel() * p.element_size() for name, p in self.model.named_parameters()}

    def full_tensors(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors of `names`, gathered from every mesh axis (a collective:
        every rank iterates in the same order)."""
        self.model.reshard()
        params = dict(self.model.named_parameters())
        for name in names:
            param = params[name]
            yield name, (param.full_tensor() if isinstance(param, DTensor) else param).detach()

    def perturb_parameters(self, scale: float, seed: int) -> None:
        """Add seeded noise to every parameter, the same in any layout."""
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                noise = (torch.randn(p.shape, generator=generator) * scale).to(p.device)
                p.add_(distribute_tensor(noise, p.device_mesh, p.placements) if isinstance(p, DTensor) else noise)

    # -- state ----------------------------------------------------------------

    def save(self, path: str, rank: int) -> None:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=os.path.join(path, "model_optim"))
        extra = {"scheduler": self.scheduler.state_dict(), "rng": torch.get_rng_state()}
        torch.save(extra, os.path.join(path, f"rank{rank}.pt"))

    def load(self, path: str, rank: int) -> None:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=os.path.join(path, "model_optim"))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        extra = torch.load(os.path.join(path, f"rank{rank}.pt"), weights_only=False)
        self.scheduler.load_state_dict(extra["scheduler"])
        torch.set_rng_state(extra["rng"])

    def export_hf(self, out_dir: str, write: bool) -> None:
        """A Hugging Face directory of the full model (a collective; the rank with `write` writes)."""
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if write:
            src = self.spec.model.path
            with torch.device("meta"):
                skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src))
            skeleton.save_pretrained(out_dir, state_dict=state)
            AutoTokenizer.from_pretrained(src).save_pretrained(out_dir)
            if os.path.isfile(os.path.join(src, "generation_config.json")):
                GenerationConfig.from_pretrained(src).save_pretrained(out_dir)
        dist.barrier()


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """The global gradient norm over every mesh axis, clipping to `max_norm` (0: no clipping).

    Parameters of one layout live on different meshes (tensor-parallel weights on
    dp x tp, norms on dp only), which torch's clip_grad_norm_ cannot stack: the norm
    is taken per group of equally placed gradients, made whole, then combined."""
    groups: dict[tuple, list[torch.nn.Parameter]] = {}
    for p in model.parameters():
        if p.grad is not None:
            key = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else (None, None)
            groups.setdefault(key, []).append(p)
    norms = []
    for params in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms))
    if max_norm:
        for params in groups.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return float(total)


def _causal_mask(padding: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] boolean: causal, no attention to padding; every position sees itself,
    so padded rows stay finite."""
    length = padding.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=padding.device).tril()
    mask = causal & padding.bool()[:, None, None, :]
    return mask | torch.eye(length, dtype=torch.bool, device=padding.device)
