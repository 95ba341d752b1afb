"""The gradient norm of a rank's parameters in any parallel layout, and clipping to it."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rlsys.trainer.weights import full_tensor


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float, pp_group) -> float:
    """The global gradient norm over every mesh axis, clipping to `max_norm` (0: no clipping).

    Parameters of one layout live on different meshes (tensor-parallel weights on
    dp x tp, norms on dp only), which torch's clip_grad_norm_ cannot stack: the norm
    is taken per group of equally placed gradients, made whole, then combined, and
    summed over the pipeline stages, which hold disjoint parameters."""
    groups: dict[tuple, list[torch.nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            key = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else (None, None)
            groups.setdefault(key, []).append(p)
    norms = [torch.zeros(())]
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True)
        norms.append(full_tensor(norm).cpu())
    squared = torch.linalg.vector_norm(torch.stack(norms)) ** 2
    if dist.get_world_size(pp_group) > 1:
        dist.all_reduce(squared, group=pp_group)
    total = squared.sqrt()
    if max_norm:
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total.to(group[0].grad.device), foreach=True)
    return float(total)
