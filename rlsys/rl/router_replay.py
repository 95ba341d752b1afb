"""Routing replay for MoE policies (`algorithm.router_replay`): the update's tokens go to the experts
another pass chose: the old pass's (R2, recorded there) or the rollout engine's (R3, sent with the
samples), so the ratio compares one routing."""

from __future__ import annotations

from transformers import AutoConfig, PretrainedConfig

from rlsys.config.loader import ConfigError
from rlsys.config.schema import RLJobConfig
from rlsys.models.moe import moe_layer_indices, num_experts
from rlsys.parallel.router_replay import engine_routing
from rlsys.rl.batch import RLBatch
from rlsys.rl.extension import StepExtension, StepGroups


class RouterReplay(StepExtension):
    def __init__(self, mode: str, model_path: str):
        self.mode, self.model_path = mode, model_path
        self.needs = frozenset({"old_logprobs", "routing"}) if mode == "r2" else frozenset()
        self.shape: tuple[list[int], int] | None = None
        """R3: the MoE layers among the model's hidden layers, and experts per token."""

    @classmethod
    def check(cls, job: RLJobConfig, model: PretrainedConfig) -> None:
        """R2 replays an MoE model's routing from the trainer's old-log-prob pass, R3 the rollout engine's,
        which vLLM records on a GPU only, for calls that each route a whole sequence."""
        from rlsys.config.limits import R3_ON_CPU, not_built

        algo = job.algorithm
        if algo.router_replay == "none":
            return
        if not num_experts(model):
            raise ConfigError("algorithm.router_replay: the model has no MoE layers to replay")
        if algo.router_replay == "r2" and algo.old_logprobs == "rollout":
            raise ConfigError("algorithm.router_replay: r2 records the routing in the trainer's old-log-prob pass; "
                              "not with old_logprobs: rollout")
        if algo.router_replay == "r3" and not (job.ray.gpus_per_worker or job.rollout.gpus_per_engine):
            raise not_built(R3_ON_CPU, "algorithm.router_replay: r3 needs the rollout engines' routing, which vLLM "
                            "returns only on a GPU (its CPU model runner does not record it); on CPU use r2")
        if algo.router_replay == "r3" and job.rollout.agent_loop == "openai":
            raise ConfigError("algorithm.router_replay: r3 not with rollout.agent_loop: openai (a harness's calls "
                              "need not continue one sequence, so no engine call routes a whole trajectory); use r2")
        if algo.router_replay == "r3" and job.rollout.context_hook:
            raise ConfigError("algorithm.router_replay: r3 not with rollout.context_hook (a rewritten history's "
                              "segment was routed by no single engine call); use r2")

    def add_inputs(self, batch: RLBatch, groups: StepGroups) -> None:
        """R3: the engine's routing of every token, as a batch field."""
        if self.mode != "r3":
            return
        if self.shape is None:
            config = AutoConfig.from_pretrained(self.model_path)
            self.shape = moe_layer_indices(config), config.num_experts_per_tok
        batch.routing = engine_routing([s.routing for s in batch.segments], batch.rows["input_ids"].shape[1],
                                       *self.shape)
