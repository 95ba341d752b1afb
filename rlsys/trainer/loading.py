"""Build a model straight into its parallel layout: the module tree is made on
the meta device, parallelized there, given empty storage for this rank's
shards only, and filled from the safetensors files, each rank reading just its
slices straight into its shards (`stored_tensors.py`). A rank's peak is its
shard, not the whole model, and no second copy of it."""

from __future__ import annotations

import zlib

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import AutoConfig

from rlsys.config.layout import ParallelConfig
from rlsys.config.model import ModelConfig
from rlsys.models import lora
from rlsys.models.head import compute_logits_in_fp32
from rlsys.models.moe import FUSED, MoEFamily, moe_family
from rlsys.models.vision import checkpoint_name, freeze_vision, model_class, place_images_by_batch, vision_tower
from rlsys.parallel.dims import ParallelDims
from rlsys.parallel.parallelize import parallelize
from rlsys.parallel.pipeline_stages import split_into_stages, stages_per_rank
from rlsys.trainer.stored_tensors import TensorReader, stored_tensors

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_parallel_model(model_cfg: ModelConfig, dims: ParallelDims, mesh: DeviceMesh, parallel: ParallelConfig,
                        device: torch.device, param_dtype: torch.dtype | None, value_head: bool = False
                        ) -> list[nn.Module]:
    """This rank's model parts: its pipeline stages, or the whole model without pipelining.
    With `value_head` (a critic) the LM head is replaced by a zero-initialised hidden -> 1
    projection, untied from the embedding, so the model's "logits" are values."""
    config = AutoConfig.from_pretrained(model_cfg.path)
    builder = model_class(config)

    def build() -> nn.Module:
        with torch.device("meta"):
            model = builder.from_config(config, dtype=DTYPES[model_cfg.dtype])
            if vision_tower(model) is not None:
                place_images_by_batch(model)
                if model_cfg.freeze_vision:
                    freeze_vision(model)
            if value_head:
                model.lm_head = nn.Linear(config.get_text_config().hidden_size, 1, bias=False,
                                          dtype=DTYPES[model_cfg.dtype])
            if model_cfg.lora.rank:
                lora.inject(model, model_cfg.lora)
            return model

    if dims.pp > 1:
        parts = split_into_stages(build, dims.pp, mesh["pp"].get_local_rank(), stages_per_rank(parallel))
    else:
        parts = [build()]
    for part in parts:
        parallelize(part, dims, mesh, parallel, param_dtype, value_head)
        _materialize(part, torch.device("cpu") if parallel.offload else device)  # FSDP2 offload: host shards
        adapters = {name for name, _ in part.named_parameters() if lora.is_adapter(name)}
        if model_cfg.random_init:
            _init_random(part, getattr(config, "initializer_range", 0.02), torch.initial_seed())
        else:
            _load_weights(part, model_cfg.path, new=adapters | ({"lm_head.weight"} if value_head else set()))
        _init_adapters(part, adapters)
        if value_head and _has_lm_head(part):
            with torch.no_grad():
                part.lm_head.weight.zero_()
        elif model_cfg.fp32_lm_head and _has_lm_head(part):
            compute_logits_in_fp32(part.lm_head)
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


@torch.no_grad()
def _load_weights(model: nn.Module, path: str, new: set[str]) -> None:
    """Every weight of `model` but those in `new`, each rank's region read from the safetensors
    files in `path` straight into its shard (`stored_tensors`); an MoE model's fused experts
    from their per-expert tensors (`_load_experts`)."""
    family = moe_family(model.config)
    state = {name: tensor for name, tensor in get_model_state_dict(model).items() if name not in new}
    experts = {name for name in state if FUSED.match(name)} if family else set()
    stored = stored_tensors(path)
    model_type = model.config.model_type
    disk = {name: family.disk_name(lora.base_name(name)) if family else
            _stored_name(lora.base_name(name), stored, model_type) for name in state if name not in experts}
    missing = [name for name in disk if disk[name] not in stored and not _tied(model, name)]
    missing += [name for name in experts if family.expert_names(name, 0)[0] not in stored]
    if missing:
        raise ValueError(f"{path}: no weights for {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
    with TensorReader(stored) as reader:
        for name, disk_name in disk.items():
            if disk_name in stored:
                local, offset = _local_and_offset(state[name])
                region = tuple(slice(o, o + n) for o, n in zip(offset, local.shape))
                reader.read_into(disk_name, region, local)
        if experts:
            _load_experts(model, family, experts, reader)


def _stored_name(name: str, stored, model_type: str) -> str:
    """`name` as the checkpoint stores it: itself, or a vision-language model's original name."""
    return name if name in stored else checkpoint_name(name, model_type)


@torch.no_grad()
def _load_experts(model: nn.Module, family: MoEFamily, names: set[str], reader: TensorReader) -> None:
    """Each fused expert parameter's local shard, read region by region from the per-expert
    tensors on disk: a rank reads its own experts' rows only."""
    params = dict(model.named_parameters())
    for name in names:
        param = params[name]
        local, offset = _local_and_offset(param)
        if local.numel():
            region = family.read_region(name, tuple(param.shape), tuple(offset), tuple(local.shape), reader.read)
            local.copy_(region)


@torch.no_grad()
def _init_random(model: nn.Module, std: float, seed: int) -> None:
    """Each parameter's local shard drawn as Hugging Face's `_init_weights` draws the whole:
    normal(0, std), norms 1, biases 0; from a generator of `seed` (the process's: the job's),
    the name and the shard's place."""
    for name, param in get_model_state_dict(model).items():
        local, offset = _local_and_offset(param)
        if name.endswith(".bias"):
            local.zero_()
        elif name.endswith("norm.weight"):
            local.fill_(1.0)
        else:
            generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{name}/{offset}".encode()))
            if local.device.type == "cpu":
                local.normal_(0.0, std, generator=generator)
            else:  # a CPU generator draws on the CPU
                local.copy_(torch.randn(local.shape, generator=generator, dtype=local.dtype).mul_(std))


@torch.no_grad()
def _init_adapters(model: nn.Module, names: set[str]) -> None:
    """Each LoRA adapter's first values (`lora.initial_adapter`), this rank's region of them."""
    for name, param in model.named_parameters():
        if name in names:
            full = lora.initial_adapter(name, tuple(param.shape))
            local, offset = _local_and_offset(param)
            region = tuple(slice(o, o + n) for o, n in zip(offset, local.shape))
            local.copy_(full[region])


def _local_and_offset(param: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """This rank's part of `param` and where it starts in the full tensor."""
    if not isinstance(param, DTensor):
        return param, (0,) * param.dim()
    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return param.to_local(), tuple(offset)


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
