"""Apply a parallel layout to a model, in torchtitan's order: tensor parallel (with sequence
and loss parallel), expert parallel, context parallel attention (or, without it, attention over
packed spans), then activation checkpointing, then FSDP2
over the data-parallel submesh. Each step is one small function in its own
module; FSDP comes last because it shards whatever the steps before left,
plain tensors or tensor-parallel DTensors alike. As in torchtitan, a data-parallel
mesh of one rank gets no FSDP where it holds plain tensors in their own dtype (`needs_fsdp`).
A layout is checked against what is built and against the model before any rank starts
(`check_layout`)."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers import PretrainedConfig

from rlsys.config.layout import ParallelConfig
from rlsys.config.loader import ConfigError
from rlsys.models.moe import moe_layer_indices
from rlsys.parallel.context_parallel import apply_cp
from rlsys.parallel.dims import LayoutError, ParallelDims
from rlsys.parallel.expert_parallel import apply_ep, apply_moe_tp
from rlsys.parallel.fsdp import apply_fsdp
from rlsys.parallel.moe_block import install_moe_blocks
from rlsys.parallel.pipeline_stages import stages_per_rank
from rlsys.parallel.span_attention import apply_span_attention
from rlsys.parallel.tp import apply_tp, check_tp_family

log = logging.getLogger(__name__)


def check_layout(parallel: ParallelConfig, model_config: PretrainedConfig) -> ParallelDims:
    """The training layout, checked against what is built so far and against the model (a
    vision-language model's language model); a ConfigError naming the key."""
    try:
        dims = ParallelDims.of(parallel)
        dims.check_model(model_config.get_text_config(), stages_per_rank(parallel))
        if dims.tp > 1:
            check_tp_family(model_config)
    except LayoutError as err:
        raise ConfigError(str(err)) from None
    return dims


def parallelize(model: nn.Module, dims: ParallelDims, mesh: DeviceMesh, parallel: ParallelConfig,
                param_dtype: torch.dtype | None, value_head: bool = False) -> nn.Module:
    """`model`'s MoE blocks (if any) become `MoEBlock`s first, whatever the layout. Whether the
    model is an MoE model is read from its config, not from the blocks this part holds: a pipeline
    stage of dense layers builds the expert meshes (collectives over every rank) as the others do."""
    install_moe_blocks(model)
    moe = bool(moe_layer_indices(model.config))
    if dims.tp > 1:
        apply_tp(model, mesh["tp"], parallel.sequence_parallel, parallel.loss_parallel, value_head)
        if moe:
            apply_moe_tp(model, mesh["tp"], parallel.sequence_parallel)
    expert_mesh = dims.expert_mesh(mesh.device_type) if moe else None
    if dims.ep > 1:
        apply_ep(model, expert_mesh["ep"])
    if dims.cp > 1:
        apply_cp(model, mesh["cp"])
    else:
        apply_span_attention(model)
    if parallel.activation_checkpointing:
        apply_activation_checkpointing(model)
    fsdp_mesh = dims.fsdp_mesh(mesh)
    if needs_fsdp(fsdp_mesh.size(), param_dtype, dims.tp, dims.ep, parallel.offload):
        # a pipeline stage runs several micro-batches forward before their backward: keep it gathered
        apply_fsdp(model, fsdp_mesh, param_dtype, reshard_after_forward=dims.pp == 1,
                   expert_mesh=dims.expert_fsdp_mesh(expert_mesh) if moe else None, offload=parallel.offload)
    else:
        log.info("one data-parallel rank computing in the weights' dtype: no FSDP")
    if parallel.offload and mesh.device_type == "cpu":
        log.info("parallel.offload on a CPU run: the weights already live in host memory; FSDP2's offload "
                 "policy runs with nothing to move")
    return model


def needs_fsdp(fsdp_ranks: int, param_dtype: torch.dtype | None, tp: int, ep: int = 1, offload: bool = False) -> bool:
    """FSDP2 on a mesh of one rank shards nothing, yet it gathers each unit's weights into a
    copy and copies its gradients out to reduce them. As one unit those copies lived through
    the step; a unit per block made them block by block and micro-batch by micro-batch.
    Without FSDP the rank computes on its parameters themselves, with a lower peak and a
    faster update (docs/performance.md). It stays for bf16 mixed precision (on a GPU by
    default), whose casts FSDP2 makes, and under tensor parallel, where it makes the parameters the plan leaves whole
    (norms, a value head) DTensors like the rest: AdamW's fused step takes no mix of the two;
    and under expert parallel, for the same reason; and to offload, which FSDP2 does."""
    return fsdp_ranks > 1 or param_dtype is not None or tp > 1 or ep > 1 or offload


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute every decoder block in backward. HF's own switch keeps the parameter
    names (a checkpoint wrapper module would add a prefix to each)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    log.info("activation checkpointing on every decoder block")
