"""Model sections: the Hugging Face model a stage starts from, and its LoRA adapters.

Each field carries its documentation as an attribute docstring; docs/configuration.md's key tables
are generated from them (`python -m rlsys.config.docs`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic.dataclasses import dataclass

from rlsys.config.base import STRICT


@dataclass(config=STRICT)
class LoraConfig:
    rank: int = Field(default=0, ge=0)
    """LoRA rank of every adapter (peft); 0 trains every weight instead. With adapters the base model is frozen,
    the optimizer holds the adapters only, and the reference policy is the base model (adapters off)."""
    alpha: float = Field(default=16.0, gt=0)
    """Adapter scaling numerator: each adapter adds alpha / rank * B @ A to its layer."""
    dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout on each adapter's input while training."""
    target_modules: list[str] = Field(default_factory=lambda: ["all-linear"])
    """Linear layers that get an adapter, by last name (q_proj, ...); all-linear: every linear layer but the
    LM head."""
    sync: Literal["adapter", "merged"] = "adapter"
    """RL: what reaches the rollout engines after each step: the adapters alone (vLLM serves them over the base
    it loaded once), or every weight with the adapters merged in (engines without LoRA support, async modes)."""

    @property
    def syncs_adapters(self) -> bool:
        """Adapters are trained and the engines receive them alone."""
        return self.rank > 0 and self.sync == "adapter"


@dataclass(config=STRICT)
class ModelConfig:
    path: str = ""
    """Hugging Face causal-LM directory (config.json, safetensors, tokenizer files), or a Hub id
    (org/name[@revision]) whose snapshot is fetched before the stage starts (docs/models.md)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype the trainer keeps parameters in; bf16 compute on GPU comes from `parallel.mixed_precision`."""
    export_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Dtype of the exported model (hf_model/); auto: the one the model's config.json names (a Hub model's
    bfloat16), else float32."""
    router_aux_loss_coef: float | None = Field(default=None, ge=0)
    """MoE models: weight of the routers' load-balancing loss in every training loss (per layer, over
    all data-parallel ranks' tokens, averaged over layers); unset takes the model config's
    `router_aux_loss_coef`, 0 turns it off."""
    random_init: bool = False
    """Start from random weights instead of the directory's (pretraining from scratch; `model.path` then needs
    only config.json and the tokenizer): normal(0, initializer_range), norms 1, biases 0, each rank drawing its
    own shards from `seed` and the shard's place, so the draw depends on the layout. Not for RL."""
    lora: LoraConfig = Field(default_factory=LoraConfig)
    """LoRA adapters (rank 0: none)."""
    freeze_vision: bool = False
    """A vision-language model: keep its vision encoder (patch and position embeddings, blocks) as loaded and
    train the language model and the mergers that project image features into it (VeRL's
    `freeze_vision_tower`)."""
    fp32_lm_head: bool = False
    """Compute the logits in fp32 from bf16 hidden states and weights, in the trainer and in the rollout
    engines (vLLM's `head_dtype`): removes the bf16 rounding of the logits from the engine/trainer log-prob gap
    (TRL's `cast_lm_head_to_fp32`, NeMo-RL's `fp32_lm_head`). Nothing changes where compute is already fp32."""
