"""Apply a parallel layout to a model, in torchtitan's order: tensor parallel
(with sequence and loss parallel), context parallel attention, then activation checkpointing, then FSDP2
over the data-parallel submesh. Each step is one small function in its own
module; FSDP comes last because it shards whatever the steps before left,
plain tensors or tensor-parallel DTensors alike."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from rlsys.config.schema import ParallelConfig
from rlsys.parallel.context_parallel import apply_cp
from rlsys.parallel.dims import ParallelDims
from rlsys.parallel.fsdp import apply_fsdp
from rlsys.parallel.tp import apply_tp

log = logging.getLogger(__name__)


def parallelize(model: nn.Module, dims: ParallelDims, mesh: DeviceMesh, parallel: ParallelConfig,
                param_dtype: torch.dtype | None, value_head: bool = False) -> nn.Module:
    if dims.tp > 1:
        apply_tp(model, mesh["tp"], parallel.sequence_parallel, parallel.loss_parallel, value_head)
    if dims.cp > 1:
        apply_cp(model, mesh["cp"])
    if parallel.activation_checkpointing:
        apply_activation_checkpointing(model)
    # a pipeline stage runs several micro-batches forward before their backward: keep it gathered
    apply_fsdp(model, dims.fsdp_mesh(mesh), param_dtype, reshard_after_forward=dims.pp == 1)
    return model


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute every decoder block in backward. HF's own switch keeps the parameter
    names (a checkpoint wrapper module would add a prefix to each)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    log.info("activation checkpointing on every decoder block")
