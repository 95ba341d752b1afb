"""LoRA adapters served by a vLLM engine from memory: the trainer's adapters after each step,
with no files. vLLM loads an adapter from a directory when a request first names it; an
adapter registered beforehand under the request's id is used as it is. Registering goes
through each vLLM worker's LoRA manager (`LoRAModel.from_lora_tensors`), as vLLM's own
loader builds it from the files.

A request must never run on a stale adapter, or on none (VeRL #7495: an adapter that never
reached the engine, and nothing said so): before every rollout the engine checks that each of
its workers holds the adapter of the newest sync."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlsys.config.model import LoraConfig
from rlsys.rollout.vllm_compat import lora_name_mapper


@dataclass(frozen=True)
class AdapterSpec:
    rank: int
    alpha: float
    target_modules: list[str]

    @classmethod
    def of(cls, lora: LoraConfig) -> AdapterSpec | None:
        """The adapters a job's engines serve (None without LoRA, or with merged weights synced)."""
        return cls(lora.rank, lora.alpha, list(lora.target_modules)) if lora.syncs_adapters else None


class ServedAdapter:
    """The one adapter an engine generates with, replaced at each sync."""

    def __init__(self, llm, spec: AdapterSpec):
        self.llm, self.spec = llm, spec
        self.request = None
        """The `LoRARequest` every request carries (None before the first sync)."""

    def load(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Serve `tensors` (peft names, `rlsys.models.lora.peft_name`) as the adapter of `version`,
        in place of the previous one."""
        from vllm.lora.request import LoRARequest

        adapter_id = version + 1  # vLLM's adapter ids start at 1
        previous = self.request.lora_int_id if self.request is not None else None
        self.llm.collective_rpc(_register, args=(adapter_id, tensors, self.spec, previous))
        self.request = LoRARequest(f"rlsys-policy-{version}", adapter_id, lora_path=f"rlsys://memory/{version}")

    def check(self) -> None:
        """Raise unless every worker of the engine holds the newest adapter."""
        if self.request is None:
            raise RuntimeError("rollout engine: no LoRA adapter has reached this engine: sync before generating")
        held = self.llm.collective_rpc(_held)
        if any(self.request.lora_int_id not in ids for ids in held):
            raise RuntimeError(f"rollout engine: LoRA adapter {self.request.lora_name} is missing from a vLLM "
                               f"worker (it holds {sorted(set().union(*held))}): generating would use a stale "
                               f"adapter or none")


# -- run inside each vLLM worker (collective_rpc) -------------------------------


def _register(worker, adapter_id: int, tensors: dict[str, torch.Tensor], spec: AdapterSpec,
              previous: int | None) -> None:
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager = worker.model_runner.lora_manager
    helper = PEFTHelper.from_dict({"r": spec.rank, "lora_alpha": spec.alpha, "target_modules": spec.target_modules})
    served = manager._adapter_manager.model  # a VL model names its layers unlike transformers: renamed
    model = LoRAModel.from_lora_tensors(adapter_id, tensors, helper, device="cpu",
                                        dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
                                        weights_mapper=lora_name_mapper(served),
                                        skip_prefixes=getattr(served, "lora_skip_prefixes", None))
    if previous is not None:
        manager.remove_adapter(previous)
    manager._adapter_manager.add_adapter(model)


def _held(worker) -> set[int]:
    return worker.model_runner.lora_manager.list_adapters()
