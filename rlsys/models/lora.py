"""LoRA adapters (peft) on a causal LM: where they go, their names, their first values,
and the two ways out of training (a peft adapter, merged weights).

peft wraps each target linear layer: the layer's weight moves to `<module>.base_layer.weight`
and the adapter adds `<module>.lora_A.default.weight` [rank, in] and `lora_B.default.weight`
[out, rank], computing base(x) + scaling * B(A(dropout(x))) with scaling = alpha / rank. The
adapters go in on the meta device, before the model is parallelized: FSDP2 must see them as
parameters of its units, or their gradients are never reduced (shared/notes: silently wrong).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from rlsys.config.layout import ParallelConfig
from rlsys.config.limits import LORA_LAYOUTS, LORA_MOE, not_built
from rlsys.config.loader import ConfigError, first_line
from rlsys.config.model import LoraConfig, ModelConfig
from rlsys.models.moe import moe_family
from rlsys.models.vision import is_vision_language, model_class

if TYPE_CHECKING:
    from transformers import PretrainedConfig

ADAPTER = re.compile(r"\.lora_[AB]\.default\.weight$")
_BASE = ".base_layer."
VISION_TOWER = r".*visual\..*"
"""A vision-language model's vision tower (`model.visual.*`), which gets no adapters: they go on the
language model (VeRL's `exclude_modules: .*visual.*`), and the tower stays as loaded."""


def inject(model: nn.Module, cfg: LoraConfig) -> None:
    """Wrap `model`'s target linear layers with adapters and freeze everything else."""
    import peft

    targets = cfg.target_modules if cfg.target_modules != ["all-linear"] else "all-linear"
    exclude = VISION_TOWER if is_vision_language(model.config) else None
    peft.inject_adapter_in_model(peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                                                 target_modules=targets, exclude_modules=exclude, bias="none"), model)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))


def is_adapter(name: str) -> bool:
    return ADAPTER.search(name) is not None


def adapted_layer(name: str) -> str | None:
    """The module whose adapted weight `name` is (`...q_proj.base_layer.weight` -> `...q_proj`), else None."""
    return name[: -len(_BASE + "weight")] if name.endswith(_BASE + "weight") else None


def adapter_names(layer: str) -> tuple[str, str]:
    """The names of `layer`'s lora_A and lora_B weights."""
    return f"{layer}.lora_A.default.weight", f"{layer}.lora_B.default.weight"


def merge(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, cfg: LoraConfig) -> torch.Tensor:
    """W + alpha / rank * B @ A in W's dtype (with some rows of W and the same rows of B: those rows)."""
    return weight + (cfg.alpha / cfg.rank * b.float() @ a.float()).to(weight.dtype)


def base_name(name: str) -> str:
    """The Hugging Face name of a wrapped model's parameter (`q_proj.base_layer.weight` -> `q_proj.weight`)."""
    return name.replace(_BASE, ".")


def initial_adapter(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """peft's first values, drawn the same on every rank and in every layout: lora_A uniform as
    `kaiming_uniform_(a=sqrt(5))` draws it, from a generator seeded by the name; lora_B zero."""
    if ".lora_B." in name:
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little"))
    bound = 1 / math.sqrt(shape[1])  # gain sqrt(2 / (1 + 5)) * sqrt(3 / fan_in)
    return torch.rand(shape, generator=generator) * 2 * bound - bound


def peft_name(name: str) -> str:
    """The name peft's `save_pretrained` writes for an adapter weight (vLLM reads the same)."""
    return "base_model.model." + name.replace(".default.weight", ".weight")


def merged(named: Iterable[tuple[str, torch.Tensor]], cfg: LoraConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, full tensor) with each adapter folded into its layer, W + alpha / rank * B @ A,
    from the wrapped model's (name, full tensor) pairs; a layer's weight waits for its two adapters."""
    held: dict[str, torch.Tensor] = {}
    for name, tensor in named:
        layer = adapted_layer(name) or (name.split(".lora_")[0] if is_adapter(name) else None)
        if layer is None:
            yield base_name(name), tensor
            continue
        held[name] = tensor
        weight_name, (a_name, b_name) = f"{layer}{_BASE}weight", adapter_names(layer)
        if all(n in held for n in (weight_name, a_name, b_name)):
            yield f"{layer}.weight", merge(held.pop(weight_name), held.pop(a_name), held.pop(b_name), cfg)


def adapter_config(cfg: LoraConfig, base_model: str, modules: list[str]) -> dict:
    """The adapter_config.json of a peft LoRA adapter over `modules` (their last names)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": cfg.rank,
            "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout, "target_modules": sorted(modules), "bias": "none",
            "fan_in_fan_out": False, "inference_mode": True, "modules_to_save": None}


def write_adapter(out_dir: str, tensors: dict[str, torch.Tensor], cfg: LoraConfig, base_model: str) -> None:
    """A peft adapter directory (adapter_model.safetensors, adapter_config.json) of the adapter
    weights `tensors` (names as in the wrapped model)."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    save_file({peft_name(n): t.contiguous() for n, t in tensors.items()},
              os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    modules = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in tensors}
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(adapter_config(cfg, base_model, sorted(modules)), f, indent=2)


def adapters_enabled(model: nn.Module, enabled: bool) -> None:
    """Turn every adapter of `model` on or off (off: the base model, e.g. the reference policy)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module._disable_adapters = not enabled


def check_lora(model: ModelConfig, parallel: ParallelConfig, model_config: PretrainedConfig) -> None:
    """LoRA trains on data- and context-parallel layouts of dense models, on target modules the
    model has."""
    if not model.lora.rank:
        return
    for degree in ("tp", "pp", "ep"):
        if getattr(parallel, degree) > 1:
            raise not_built(LORA_LAYOUTS, f"parallel.{degree}: LoRA adapters (model.lora.rank) train on dp_shard, "
                            f"dp_replicate and cp layouts; not with parallel.{degree} > 1 yet")
    if moe_family(model_config):
        raise not_built(LORA_MOE, f"model.lora.rank: LoRA on MoE models ({model_config.model_type}) is not built yet")
    with torch.device("meta"):
        try:
            inject(model_class(model_config).from_config(model_config), model.lora)
        except ValueError as err:
            raise ConfigError(f"model.lora.target_modules: {first_line(err)}") from None
