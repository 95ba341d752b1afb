"""Build a model straight into its parallel layout: the module tree is made on
the meta device, parallelized there, given empty storage for this rank's
shards only, and filled from the safetensors files, each rank reading just its
slices (torch.distributed.checkpoint's Hugging Face reader). A rank's peak is
about its shard, not the whole model."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from transformers import AutoConfig, AutoModelForCausalLM

from rlsys.config.schema import ModelConfig, ParallelConfig
from rlsys.parallel.dims import ParallelDims
from rlsys.parallel.parallelize import parallelize
from rlsys.parallel.pipeline_stages import split_into_stages, stages_per_rank

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_parallel_model(model_cfg: ModelConfig, dims: ParallelDims, mesh: DeviceMesh, parallel: ParallelConfig,
                        device: torch.device, param_dtype: torch.dtype | None, value_head: bool = False
                        ) -> list[nn.Module]:
    """This rank's model parts: its pipeline stages, or the whole model without pipelining.
    With `value_head` (a critic) the LM head is replaced by a zero-initialised hidden -> 1
    projection, untied from the embedding, so the model's "logits" are values."""
    config = AutoConfig.from_pretrained(model_cfg.path)

    def build() -> nn.Module:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[model_cfg.dtype])
            if value_head:
                model.lm_head = nn.Linear(config.hidden_size, 1, bias=False, dtype=DTYPES[model_cfg.dtype])
            return model

    if dims.pp > 1:
        parts = split_into_stages(build, dims.pp, mesh["pp"].get_local_rank(), stages_per_rank(parallel))
    else:
        parts = [build()]
    for part in parts:
        parallelize(part, dims, mesh, parallel, param_dtype, value_head)
        _materialize(part, device)
        _load_weights(part, model_cfg.path, new={"lm_head.weight"} if value_head else set())
        if value_head and _has_lm_head(part):
            with torch.no_grad():
                part.lm_head.weight.zero_()
        _init_rotary_buffers(part, device)
    return parts


def _materialize(part: nn.Module, device: torch.device) -> None:
    """Empty storage on `device` for the meta-device `part`. `to_empty` gives every module a
    parameter of its own, so weights tied across modules (an LM head tied to the embedding)
    are tied again; FSDP2 keeps its units' ties itself."""
    ties = [] if isinstance(part, FSDPModule) else _ties(part)
    part.to_empty(device=device)
    for module, name, owner, owner_name in ties:
        setattr(module, name, getattr(owner, owner_name))


def _ties(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module, str]]:
    """(module, name, owner, owner's name) for each parameter registered again after its first module."""
    first: dict[int, tuple[nn.Module, str]] = {}
    ties = []
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in first:
                ties.append((module, name, *first[id(param)]))
            else:
                first[id(param)] = (module, name)
    return ties


def _has_lm_head(part: nn.Module) -> bool:
    return getattr(part, "lm_head", None) is not None


def _load_weights(model: nn.Module, path: str, new: set[str]) -> None:
    """Every weight of `model` but those in `new` from the safetensors files in `path`."""
    state = {name: tensor for name, tensor in get_model_state_dict(model).items() if name not in new}
    stored = _stored_names(path)
    missing = [name for name in state if name not in stored and not _tied(model, name)]
    if missing:
        raise ValueError(f"{path}: no weights for {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
    state = {name: tensor for name, tensor in state.items() if name in stored}
    dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(path))
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))


def _stored_names(path: str) -> set[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return set(json.load(f)["weight_map"])
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def _tied(model: nn.Module, name: str) -> bool:
    """The LM head of a model that ties it to the input embedding is not stored on its own."""
    return name == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False)


def _init_rotary_buffers(model: nn.Module, device: torch.device) -> None:
    """Rotary inverse frequencies are computed, not stored: make them again for real."""
    for module in model.modules():
        if hasattr(module, "inv_freq") and hasattr(module, "config"):
            fresh = type(module)(module.config)
            for name, buffer in fresh.named_buffers(recurse=False):
                setattr(module, name, buffer.to(device))
