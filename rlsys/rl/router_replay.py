"""Routing replay for MoE policies (`algorithm.router_replay`): the update's tokens go to the experts
another pass chose: the old pass's (R2, recorded there) or the rollout engine's (R3, sent with the
samples), so the ratio compares one routing."""

from __future__ import annotations

from transformers import AutoConfig

from rlsys.models.moe import moe_layer_indices
from rlsys.parallel.router_replay import engine_routing
from rlsys.rl.batch import RLBatch
from rlsys.rl.extension import StepExtension, StepGroups


class RouterReplay(StepExtension):
    def __init__(self, mode: str, model_path: str):
        self.mode, self.model_path = mode, model_path
        self.needs = frozenset({"old_logprobs", "routing"}) if mode == "r2" else frozenset()
        self.shape: tuple[list[int], int] | None = None
        """R3: the MoE layers among the model's hidden layers, and experts per token."""

    def add_inputs(self, batch: RLBatch, groups: StepGroups) -> None:
        """R3: the engine's routing of every token, as a batch field."""
        if self.mode != "r3":
            return
        if self.shape is None:
            config = AutoConfig.from_pretrained(self.model_path)
            self.shape = moe_layer_indices(config), config.num_experts_per_tok
        batch.routing = engine_routing([s.routing for s in batch.segments], batch.rows["input_ids"].shape[1],
                                       *self.shape)
