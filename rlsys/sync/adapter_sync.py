"""Trainer -> rollout sync of a LoRA policy: the adapters alone.

The engines loaded the base model from disk when they started and keep it; after each step
rank 0 gathers the full adapter weights (a collective of the training group: they are a few
MB where the model is GB), and every engine registers them in memory as the adapter of the
new version (`rlsys.rollout.adapters`)."""

from __future__ import annotations

import time

import ray

from rlsys.models.lora import peft_name


class AdapterSync:
    """Same interface as `WeightSync`: `run(version)` returns the sync's metrics."""

    def __init__(self, train_group, rollout_group):
        self.train_group, self.rollout_group = train_group, rollout_group

    def run(self, version: int = 0) -> dict[str, float]:
        started = time.perf_counter()
        gathered = self.train_group.run_all("adapter_tensors")
        tensors = {peft_name(name): tensor for name, tensor in next(t for t in gathered if t is not None).items()}
        self.rollout_group.run_all("load_adapter", ray.put(tensors), version=version)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return {"sync/time_s": time.perf_counter() - started, "sync/in_place": 0.0, "sync/buckets": 1,
                "sync/mb": nbytes / 2**20}
