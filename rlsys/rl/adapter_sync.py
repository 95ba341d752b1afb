"""Trainer -> rollout sync of a LoRA policy: the adapters alone.

The engines loaded the base model from disk when they started and keep it; after each step
every training rank packs its own shards of the adapters (a few MB where the model is GB; no
collective among the ranks), and every engine reassembles them from the ranks' buffers, as a
bucket of the full-weight sync, and registers them in memory as the adapter of the new
version (`rlsys.rollout.adapters`)."""

from __future__ import annotations

import time

from rlsys.actors.rollout_worker import RolloutWorker
from rlsys.actors.train_worker import TrainWorker
from rlsys.config.limits import LORA_ADAPTER_SYNC_ASYNC, not_built
from rlsys.config.model import ModelConfig
from rlsys.config.rl import RLTrainConfig


def check_adapter_sync(model: ModelConfig, train: RLTrainConfig) -> None:
    """The adapters alone reach engines between steps, not while they generate (asynchronous RL)."""
    if model.lora.syncs_adapters and train.async_mode != "off":
        raise not_built(LORA_ADAPTER_SYNC_ASYNC, "train.async_mode: the adapter sync runs with async_mode: off; "
                        "for asynchronous RL with LoRA set model.lora.sync: merged")


class AdapterSync:
    """Same interface as `WeightSync`: `run(version)` returns the sync's metrics."""

    def __init__(self, train_group, rollout_group):
        self.train_group, self.rollout_group = train_group, rollout_group

    def run(self, version: int = 0) -> dict[str, float]:
        """An engine that dies meanwhile is replaced and the adapters sent to every engine again."""
        started = time.perf_counter()
        try:
            nbytes = self._load(list(range(len(self.rollout_group.actors))), version)
        except Exception as err:  # a dead engine is replaced here; anything else goes on up
            self.rollout_group.replace_dead(err)
            nbytes = self._load(list(range(len(self.rollout_group.actors))), version)
        return {"sync/time_s": time.perf_counter() - started, "sync/in_place": 0.0, "sync/buckets": 1,
                "sync/mb": nbytes / 2**20}

    def load_into(self, engine: int, version: int) -> None:
        """Send the adapters to engine `engine` alone (one that replaced a dead engine), labelled `version`."""
        self._load([engine], version)

    def _load(self, engines: list[int], version: int) -> int:
        shards = self.train_group.submit_all(TrainWorker.adapter_shards)
        calls = [self.rollout_group.submit(engine, RolloutWorker.load_adapter, *shards, version=version)
                 for engine in engines]
        return self.rollout_group.wait(calls, engines)[0]
