"""What one training rank holds of a model under a layout, without building it: every
parameter's local shape after the tensor-parallel plan, expert parallel, the pipeline cut and
FSDP2, split the way those layers split it.

DTensor and FSDP2 both cut a dimension as `torch.chunk` does: pieces of ceil(n / parts), the
last ones smaller or empty. FSDP2 cuts the local tensor tensor parallel left (dim 0; an
expert's dim 1, after expert parallel cut dim 0 by expert). The plans are `rlsys.parallel`'s
own (`tp.top_plan`, `tp.block_plan`, `pipeline_stages.stage_layers`; whether FSDP2 wraps at all:
`parallelize.needs_fsdp`), read off a model built on the meta device, so a change there changes
the estimate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from rlsys.parallel.dims import ParallelDims
from rlsys.parallel.moe_block import GroupedExperts, install_moe_blocks
from rlsys.parallel.pipeline_stages import rank_stage_indices, stage_layers
from rlsys.parallel.tp import block_plan, top_plan


def chunk(size: int, parts: int, index: int) -> int:
    """Length of piece `index` when `torch.chunk` cuts `size` into `parts`."""
    piece = -(-size // parts)
    return max(0, min(piece, size - index * piece))


@dataclass(frozen=True)
class Param:
    """One parameter of the model and how the layout may split it."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None
    """The dimension tensor parallel splits (None: replicated over tp)."""
    expert: bool
    """An MoE layer's grouped experts: split by expert over ep, sharded over efsdp."""
    layer: int | None
    """Its decoder layer (None: the embedding, the final norm, the LM head)."""


class ModelShapes:
    """The parameters of the model in an HF config, on the meta device (no memory, no weights)."""

    def __init__(self, config, value_head: bool = False):
        import transformers

        self.config = config
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        install_moe_blocks(model)
        if value_head:  # a critic: one value per token in place of the vocabulary
            model.lm_head = nn.Linear(config.hidden_size, 1, bias=False, device="meta")
        self.tied = bool(getattr(config, "tie_word_embeddings", False)) and not value_head
        self.params = _params(model, value_head)

    @cached_property
    def total(self) -> int:
        return sum(math.prod(p.shape) for p in self.params)

    @cached_property
    def expert_total(self) -> int:
        return sum(math.prod(p.shape) for p in self.params if p.expert)

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers


def _params(model: nn.Module, value_head: bool) -> list[Param]:
    residual = Replicate()
    styles = {f"{name}.": style for name, style in top_plan(residual, False, False, value_head).items()}
    for index, block in enumerate(model.model.layers):
        styles.update({f"model.layers.{index}.{name}.": style
                       for name, style in block_plan(block, residual, False).items()})
    experts = {name for name, module in model.named_modules() if isinstance(module, GroupedExperts)}
    params = []
    for name, param in model.named_parameters():  # a tied LM head is the embedding: counted once
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        style = styles.get(f"{module_name}.")
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        params.append(Param(name, tuple(param.shape), _tp_dim(style, module, leaf), module_name in experts, layer))
    return params


def _tp_dim(style, module: nn.Module, leaf: str) -> int | None:
    """Colwise splits a linear layer's outputs (weight and bias rows); rowwise its inputs
    (weight columns; bias replicated) and an embedding's rows (the vocabulary)."""
    if isinstance(style, ColwiseParallel):
        return 0
    if isinstance(style, RowwiseParallel) and leaf == "weight":
        return 0 if isinstance(module, nn.Embedding) else 1
    return None


@dataclass(frozen=True)
class RankShards:
    """Elements of the model one rank holds: all of them, and the experts' share."""

    elements: int
    expert_elements: int
    layers: tuple[int, ...]
    """The decoder layers its pipeline stages hold."""
    last_stage: bool
    """It holds the final norm and the LM head (and computes the logits)."""


def rank_shards(shapes: ModelShapes, dims: ParallelDims, rank: int, stages_per_rank: int = 1,
                fsdp: bool = True) -> RankShards:
    """What `rank` holds. `fsdp`: whether FSDP2 wraps the model (`parallelize.needs_fsdp`)."""
    at = dims.coordinates(rank)
    stages = rank_stage_indices(at.pp, dims.pp, stages_per_rank)
    num_stages = dims.pp * stages_per_rank
    cut = stage_layers(shapes.num_layers, num_stages) if dims.pp > 1 else [range(shapes.num_layers)]
    layers = tuple(layer for stage in stages for layer in cut[stage])
    first, last = 0 in stages, num_stages - 1 in stages
    token_index = (at.dp_shard * dims.cp + at.cp) * dims.tp + at.tp  # on the expert mesh: (efsdp, ep)
    fsdp_parts, fsdp_index = dims.dp_shard * dims.cp, at.dp_shard * dims.cp + at.cp
    elements = expert_elements = 0
    for param in shapes.params:
        if not _on_stage(param, layers, first, last, dims.pp > 1):
            continue
        shape = list(param.shape)
        if param.expert:
            shape[0] = chunk(shape[0], dims.ep, token_index % dims.ep)
            if fsdp:
                shape[1] = chunk(shape[1], dims.efsdp, token_index // dims.ep)
        else:
            if param.tp_dim is not None:
                shape[param.tp_dim] = chunk(shape[param.tp_dim], dims.tp, at.tp)
            if fsdp:
                shape[0] = chunk(shape[0], fsdp_parts, fsdp_index)
        count = math.prod(shape)
        elements += count
        expert_elements += count if param.expert else 0
    return RankShards(elements, expert_elements, layers, last)


def _on_stage(param: Param, layers: tuple[int, ...], first: bool, last: bool, pipelined: bool) -> bool:
    if param.layer is not None:
        return param.layer in layers
    if not pipelined:
        return True
    embedding = param.name.startswith("model.embed_tokens")
    return (embedding and first) or (not embedding and last)  # the final norm and the LM head: last
