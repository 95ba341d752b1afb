"""Vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) in the trainer and the engines: which
models are such, what their engines are told about images, how the trainer builds, names and runs them.

The trainer's module tree is transformers' (`model.visual.*`, `model.language_model.*`,
`lm_head`). Qwen2-VL's and Qwen2.5-VL's checkpoints keep their original names (`visual.*`,
`model.*`), which `checkpoint_name` maps to; Qwen3-VL's store the module names. vLLM's loader
takes either, so the weight sync sends the module names.
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING

import torch
from torch import nn

from rlsys.config.layout import ParallelConfig
from rlsys.config.limits import MODEL_FAMILIES, VISION_LANGUAGE, not_built
from rlsys.config.loader import ConfigError
from rlsys.config.model import ModelConfig
from rlsys.models.vision_compat import allow_qwen_vl_without_torchvision

if TYPE_CHECKING:
    from rlsys.config.schema import RLJobConfig

IMAGES_PER_PROMPT = 4
"""The pictures a prompt may hold, by default (`rollout.engine_kwargs.limit_mm_per_prompt` sets it)."""

VL_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
"""Model types the trainer's vision-language path is built and tested for."""

_ORIGINAL_NAMES = ("qwen2_vl", "qwen2_5_vl")
"""Families whose checkpoints keep the names of before transformers' module tree (`checkpoint_name`)."""

_CHECKPOINT_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))

_TRAINED_WITH_FROZEN_VISION = ("merger.", "deepstack_merger_list.")
"""The vision tower's parts that project its features into the language model, which train under
`model.freeze_vision` (Qwen3-VL's deepstack mergers project features of earlier blocks)."""


def is_vision_language(config) -> bool:
    """A model with a vision tower (Qwen2-VL's family: its config has a `vision_config`)."""
    return getattr(config, "vision_config", None) is not None


def check_vision_language(config, model: ModelConfig, parallel: ParallelConfig, stage: str,
                          rl: RLJobConfig | None = None) -> None:
    """What a vision-language model trains with so far (docs/vision.md): Qwen2-VL, Qwen2.5-VL and
    Qwen3-VL, the sft and rlvr stages, data and tensor parallel, every weight or LoRA adapters on the
    language model; in RL, the single-turn or tool loop, a critic too, without a teacher, with the
    trainer's processor settings."""
    if not is_vision_language(config):
        if model.freeze_vision:
            raise ConfigError(f"model.freeze_vision: {model.path} has no vision tower")
        return
    if config.model_type not in VL_FAMILIES:
        raise not_built(MODEL_FAMILIES, f"model.path: {model.path} is a vision-language model of type "
                        f"{config.model_type!r}; training is built for {', '.join(VL_FAMILIES)} (docs/vision.md)")
    refusals = {
        "stage": stage not in ("sft", "rlvr"), "parallel.pp": parallel.pp > 1, "parallel.cp": parallel.cp > 1,
        "parallel.sequence_parallel": parallel.sequence_parallel,
    }
    if rl is not None:
        refusals.update({
            "algorithm.distill": rl.algorithm.distill is not None,
            "rollout.agent_loop": rl.rollout.agent_loop == "openai",
            "rollout.engine_kwargs.mm_processor_kwargs": "mm_processor_kwargs" in rl.rollout.engine_kwargs,
        })
    for key, refused in refusals.items():
        if refused:
            raise not_built(VISION_LANGUAGE, f"{key}: not built yet for a vision-language model "
                            f"({type(config).__name__}): it trains with the sft and rlvr stages on data- and "
                            "tensor-parallel layouts, in RL with the single_turn or tool loop (docs/vision.md)")

def engine_image_limits(config) -> dict:
    """vLLM's `limit_mm_per_prompt` for the model: images (videos need torchvision and are refused); none
    for a text model."""
    return {"limit_mm_per_prompt": {"image": IMAGES_PER_PROMPT, "video": 0}} if is_vision_language(config) else {}


def images_per_prompt(engine_kwargs: dict) -> int:
    """The pictures a prompt may hold in engines started with `engine_kwargs` (`rollout.engine_kwargs`)."""
    limits = engine_kwargs.get("limit_mm_per_prompt") or {}
    return int(limits.get("image", IMAGES_PER_PROMPT))


def model_class(config):
    """The transformers class that builds the trainer's model from `config`."""
    if not is_vision_language(config):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM
    allow_qwen_vl_without_torchvision()
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText


def checkpoint_name(name: str, model_type: str) -> str:
    """The name a weight of a model of `model_type` has in its checkpoint."""
    if model_type not in _ORIGINAL_NAMES:
        return name
    for module_prefix, stored_prefix in _CHECKPOINT_PREFIXES:
        if name.startswith(module_prefix):
            return stored_prefix + name[len(module_prefix):]
    return name


def vision_tower(model: nn.Module) -> nn.Module | None:
    return getattr(getattr(model, "model", None), "visual", None)


def freeze_vision(model: nn.Module) -> None:
    """Train the language model and the mergers only: the vision tower's encoder (patch and
    position embeddings, blocks) keeps its weights."""
    tower = vision_tower(model)
    for name, param in tower.named_parameters():
        if not name.startswith(_TRAINED_WITH_FROZEN_VISION):
            param.requires_grad_(False)


def place_images_by_batch(model: nn.Module) -> None:
    """The pictures' features go where the batch put pixels, not onto every image pad token: a
    policy may sample one, which the engine embeds as text. Transformers finds the places in
    `get_placeholder_mask`; this model's reads them from `image_positions`, which `image_inputs`
    sets before each forward."""
    language_vision = model.model

    def placeholder_mask(self, input_ids, inputs_embeds, image_features=None, video_features=None):
        positions = self.image_positions
        if positions is None:  # a forward not through the trainer's engine: transformers' own way
            return type(self).get_placeholder_mask(self, input_ids, inputs_embeds, image_features, video_features)
        if image_features is not None and positions.any() and positions.sum() != image_features.shape[0]:
            raise ValueError(f"{int(positions.sum())} image tokens for {image_features.shape[0]} features")
        mask = positions.unsqueeze(-1).expand_as(inputs_embeds)
        return mask, torch.zeros_like(mask)

    language_vision.image_positions = None
    language_vision.get_placeholder_mask = types.MethodType(placeholder_mask, language_vision)


def image_inputs(model: nn.Module, image_tokens: torch.Tensor | None, pixels: torch.Tensor | None,
                 grids: torch.Tensor | None, rows: int, width: int, device: torch.device, idle: bool = False) -> dict:
    """The forward's image arguments for a micro-batch of `rows` x `width` tokens whose image fields
    (`rlsys.data.image_tokens`) are `image_tokens`, `pixels` and `grids` (None: no pictures): its
    image tokens' patches in token order, its pictures' grids, and which tokens are image tokens
    (for the 3-D rotary positions). A micro-batch without pictures has none, or with `idle` one
    blank picture of the smallest grid that fills no token: the vision tower still runs forward
    and backward (a zero gradient) in its place in the model, so the collectives of its FSDP units
    pair up with those of data-parallel ranks whose micro-batch has pictures (VeRL's dummy image)."""
    merge = model.config.vision_config.spatial_merge_size
    positions = torch.zeros(rows, width, dtype=torch.bool) if image_tokens is None else image_tokens[:, :width].bool()
    model.model.image_positions = positions.to(device)
    if positions.any():
        patches = torch.cat([row[:count] for row, count in zip(pixels, positions.sum(1).tolist())])
        patches, image_grids = patches.reshape(patches.shape[0] * merge ** 2, -1), grids[grids[..., 0] > 0]
    elif idle:
        vision = model.config.vision_config
        patches = torch.zeros(merge ** 2, vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2)
        image_grids = torch.tensor([[1, merge, merge]])
    else:
        return {}
    return {"pixel_values": patches.to(device), "image_grid_thw": image_grids.to(device),
            "mm_token_type_ids": positions.int().to(device)}


def rope_positions(model: nn.Module, input_ids: torch.Tensor, image_tokens: torch.Tensor | None,
                   grids: torch.Tensor | None, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T, 3]: the 3-D rotary positions (temporal, height, width) of the right-padded rows
    `input_ids`, whose image tokens and pictures' grids are `image_tokens` and `grids` (None: no
    pictures), as the model's forward derives them; a packed micro-batch carries them per token
    (`rlsys.data.packed_pictures`), since its forward cannot derive them from packed rows."""
    token_types = torch.zeros_like(input_ids) if image_tokens is None else image_tokens.long()
    pictures = None if grids is None or not token_types.any() else grids[grids[..., 0] > 0]
    positions, _ = model.model.get_rope_index(input_ids=input_ids, mm_token_type_ids=token_types,
                                              image_grid_thw=pictures, attention_mask=attention_mask)
    return positions.permute(1, 2, 0)
