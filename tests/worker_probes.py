"""What tests do inside the training ranks that a run never does: run a loss's forward and
backward without stepping, read the full gradients and shard shapes, perturb the policy.
Each is a function of the worker, run on every rank through `ActorGroup.on_each`; this module
travels to the actors by value (they cannot import the tests)."""

from __future__ import annotations

import sys
import zlib

import ray
import torch
from ray import cloudpickle
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from rlsys.data.batching import split_rows

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def forward_backward(group, batch, loss_fn) -> list[dict[str, float]]:
    """Accumulate `loss_fn`'s gradients over `batch`, split as the group splits a training batch
    (without an optimizer step); the collected ranks' metrics, in data-parallel order."""
    return _on_shards(group, batch, _forward_backward, loss_fn)


def _on_shards(group, batch, fn, *args) -> list:
    """`fn(worker, shard, *args)` on every rank, `batch` split as the group splits a training
    batch; the collected ranks' results, in data-parallel order."""
    shards = [ray.put(shard) for shard in split_rows(batch, group.dims.dp_size)]
    refs = [actor.__ray_call__.remote(fn, shards[group.dp_ranks[rank]], *args)
            for rank, actor in enumerate(group.actors)]
    outputs = group.wait(refs)
    return [outputs[rank] for _, rank in group.collected]


def _forward_backward(worker, shard, loss_fn) -> dict[str, float]:
    metrics, _ = worker.policy.forward_backward(shard, loss_fn)
    return metrics


def routed_pass(group, batch) -> list[tuple[dict[str, float], dict[str, torch.Tensor]]]:
    """A forward pass of the log-probs over `batch`, recording the experts each token went to
    (replaying them where `batch` holds a routing): the collected ranks' metrics and rows."""
    from rlsys.algorithms.lm_loss import token_logprobs

    return _on_shards(group, batch, _routed_pass, token_logprobs())


def _routed_pass(worker, shard, loss_fn):
    return worker.policy.forward_backward(shard, loss_fn, forward_only=True, record_routing=True)


def full_gradients(worker) -> dict[str, torch.Tensor]:
    """Unsharded gradients by parameter name (gathers: run it on every rank)."""
    return {name: _full(p.grad).cpu() for name, p in worker.policy.named_parameters()}


def zero_grad(worker) -> None:
    worker.policy.zero_grad()


def local_shapes(worker) -> dict[str, tuple[int, ...]]:
    """The shape of this rank's shard of each parameter."""
    return {name: tuple((p.to_local() if isinstance(p, DTensor) else p).shape)
            for name, p in worker.policy.named_parameters()}


def attends_spans_where_it_can(worker) -> bool:
    """Whether the policy's packed micro-batches that share prompts attend span by span: every model
    the tests train can, a vision-language model's language model too (under context parallel, by
    Ulysses' attention)."""
    return worker.policy.span_attention


def perturb_parameters(worker, scale: float, seed: int, trained_only: bool = False, names: str = "") -> None:
    """Add seeded noise to every parameter of the policy (with `trained_only`, to those it trains:
    LoRA's adapters; with `names`, to those whose names start with it), the same in any layout
    (seeded by name), so that it differs from the rollout engines' weights. Each rank adds its
    shard's region of the full noise (the region the weight sync sends it as)."""
    with torch.no_grad():
        for name, p in worker.policy.named_parameters():
            if trained_only and not p.requires_grad or not name.startswith(names):
                continue
            generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            noise = torch.randn(p.shape, generator=generator) * scale
            if isinstance(p, DTensor):
                shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                noise = noise[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
                p.to_local().add_(noise.to(p.device))
            else:
                p.add_(noise.to(p.device))


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def pipeline_micro_batches(worker, shard) -> int:
    """How many micro-batches the pipeline schedule splits `shard` into on this rank."""
    return worker.policy._pipeline_micro_batches(shard)


def shared_memory_queues(rollout_worker) -> set[str]:
    """The /dev/shm/psm_* segments (vLLM's shared-memory queues) that the engine's process and its
    worker processes map."""
    import psutil

    me = psutil.Process()
    return {m.path for process in (me, *me.children(recursive=True)) for m in process.memory_maps(grouped=True)
            if m.path.startswith("/dev/shm/psm_")}


def experts_repacked(rollout_worker) -> list[int]:
    """How many MoE layers each vLLM worker of a rollout engine has packed again after syncs."""
    return rollout_worker.llm.collective_rpc(_experts_repacked)


def _experts_repacked(vllm_worker) -> int:
    return getattr(vllm_worker, "rlsys_repacked", 0)


def perturb_adapters(worker, scale: float, seed: int) -> None:
    """`perturb_parameters` of the LoRA adapters only."""
    perturb_parameters(worker, scale, seed, trained_only=True)


def full_adapters(worker) -> dict[str, torch.Tensor]:
    """The policy's full adapter weights (gathers: run it on every rank)."""
    return {name: _full(p).detach().cpu().clone() for name, p in worker.policy.named_parameters() if p.requires_grad}


def adapter_gradients(worker) -> dict[str, torch.Tensor]:
    """Unsharded gradients of the trained parameters (gathers: run it on every rank)."""
    return {name: _full(p.grad).cpu() for name, p in worker.policy.named_parameters() if p.requires_grad}


def trained_and_frozen(worker) -> tuple[int, int]:
    """(parameters in the optimizer, parameters without a gradient)."""
    trained = sum(len(group["params"]) for opt in worker.policy.optimizers for group in opt.param_groups)
    frozen = sum(not p.requires_grad for _, p in worker.policy.named_parameters())
    return trained, frozen


def drop_served_adapter(rollout_worker) -> None:
    """Remove the served adapter from the engine's vLLM workers, as if it had never arrived."""
    adapter_id = rollout_worker.adapter.request.lora_int_id
    rollout_worker.llm.collective_rpc(_remove_adapter, args=(adapter_id,))


def _remove_adapter(vllm_worker, adapter_id: int) -> None:
    vllm_worker.model_runner.lora_manager.remove_adapter(adapter_id)
