"""Mixture-of-Experts model families: where their experts live in memory and on disk.

In memory (transformers >= 5) every family keeps a layer's experts as two fused parameters,
`<block>.experts.gate_up_proj` [E, 2I, H] (each expert's gate rows, then its up rows) and
`<block>.experts.down_proj` [E, H, I], beside the router `<block>.gate.weight` [E, H]. On disk
(what `save_pretrained` writes by default, what vLLM and other tools read) each expert is a
set of its own tensors, under the family's names: `mlp.experts.{j}.gate_proj.weight` for
Qwen2-MoE and Qwen3-MoE, `block_sparse_moe.experts.{j}.w1.weight` for Mixtral. This module
maps one to the other: a rank reads only its region of a fused parameter (its experts, its
rows) from the per-expert tensors, and an export writes the per-expert names back.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

FUSED = re.compile(r"^(?P<layer>.*\.layers\.\d+)\.mlp\.experts\.(?P<kind>gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class MoEFamily:
    disk_block: str
    """The MoE block's name on disk (transformers renames Mixtral's `block_sparse_moe` to `mlp`)."""
    gate: str
    up: str
    down: str
    """The per-expert projections' names on disk."""

    def disk_name(self, name: str) -> str:
        """The name on disk of a parameter outside the fused experts (a router, say)."""
        return name.replace(".mlp.", f".{self.disk_block}.") if self.disk_block != "mlp" else name

    def expert_names(self, fused: str, expert: int) -> list[str]:
        """The disk tensors one expert's slice of a fused parameter is made of, in order."""
        match = FUSED.match(fused)
        prefix = f"{match['layer']}.{self.disk_block}.experts.{expert}"
        projections = (self.gate, self.up) if match["kind"] == "gate_up_proj" else (self.down,)
        return [f"{prefix}.{projection}.weight" for projection in projections]

    def to_disk(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """A full parameter under its disk names: a fused one as a view per expert and projection."""
        if not FUSED.match(name):
            return [(self.disk_name(name), tensor)]
        out = []
        for expert, weights in enumerate(tensor):
            names = self.expert_names(name, expert)
            out.extend(zip(names, weights.chunk(len(names))))
        return out

    def read_region(self, name: str, full_shape: tuple[int, ...], offset: tuple[int, ...], shape: tuple[int, ...],
                    read: Callable[[str, tuple[slice, ...]], torch.Tensor]) -> torch.Tensor:
        """The region `shape` at `offset` of the fused parameter `name` (of `full_shape`),
        assembled from the per-expert disk tensors; `read(disk_name, index)` reads one slice
        of one of them."""
        (e0, r0, c0), (experts, rows, cols) = offset, shape
        region = []
        for expert in range(e0, e0 + experts):
            names = self.expert_names(name, expert)
            length = full_shape[1] // len(names)  # rows of each projection
            parts = []
            for index, disk in enumerate(names):
                lo, hi = max(r0, index * length), min(r0 + rows, (index + 1) * length)
                if lo < hi:
                    parts.append(read(disk, (slice(lo - index * length, hi - index * length), slice(c0, c0 + cols))))
            region.append(torch.cat(parts))
        return torch.stack(region)


QWEN_MOE = MoEFamily(disk_block="mlp", gate="gate_proj", up="up_proj", down="down_proj")
MIXTRAL = MoEFamily(disk_block="block_sparse_moe", gate="w1", up="w3", down="w2")
FAMILIES = {"qwen2_moe": QWEN_MOE, "qwen3_moe": QWEN_MOE, "mixtral": MIXTRAL}
"""Model types whose experts rlsys trains, shards and syncs (each loads in vLLM)."""


def num_experts(config: PretrainedConfig) -> int:
    """Routed experts per MoE layer of an HF config; 0 for a dense model."""
    return getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0


def moe_layer_indices(config: PretrainedConfig) -> list[int]:
    """The decoder layers whose MLP is a sparse MoE block, in order, as HF builds them: every layer of
    a Mixtral; a Qwen-MoE layer unless `mlp_only_layers` names it or `decoder_sparse_step` skips it."""
    if not num_experts(config):
        return []
    layers = range(config.num_hidden_layers)
    if config.model_type == "mixtral":
        return list(layers)
    step, dense = getattr(config, "decoder_sparse_step", 1) or 1, set(getattr(config, "mlp_only_layers", []) or [])
    return [i for i in layers if i not in dense and (i + 1) % step == 0]


def moe_family(config: PretrainedConfig) -> MoEFamily | None:
    """The family of an MoE model's config; None for a dense model. Raises ValueError for an MoE
    model of another family."""
    if not num_experts(config):
        return None
    if config.model_type not in FAMILIES:
        raise ValueError(f"MoE model type {config.model_type!r} is not supported "
                         f"(MoE families: {', '.join(sorted(FAMILIES))})")
    return FAMILIES[config.model_type]
