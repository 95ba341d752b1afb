"""The rollout group: vLLM engines in Ray actors sharing each prompt batch, each running the
agent loops of its share."""

from __future__ import annotations

from dataclasses import replace

import ray

from rlsys.actors.cluster import actor_name, spawn
from rlsys.actors.engine_placement import engine_keep_key, place_engines
from rlsys.actors.failures import CallLimit
from rlsys.actors.group import ENGINE_STOP_S, ActorGroup, contiguous_shares
from rlsys.actors.rollout_worker import RolloutWorker, RolloutWorkerSpec
from rlsys.agents.loop import AgentLoop
from rlsys.agents.trajectory import Sampling, Trajectory
from rlsys.config.rollout import RolloutConfig, ToolsConfig
from rlsys.rollout.adapters import AdapterSpec
from rlsys.seeds import engine_seed

ENGINE_ENV = {"THP_MEM_ALLOC_ENABLE": "1"}
"""Transparent huge pages for torch's CPU allocations of 2 MiB and more in the engines: a
colocated engine's weights are freed in every update and grown back for the sync, and 2 MiB
pages fault in faster than 4 KiB ones. No effect on GPU memory."""


class RolloutGroup(ActorGroup[RolloutWorker]):
    stop_timeout_s = ENGINE_STOP_S

    def __init__(self, model_path: str, cfg: RolloutConfig, seed: int, train_placement, train_cpus: float,
                 gpu_share: float = 0.0, loops: dict[str, type[AgentLoop]] | None = None,
                 tools: ToolsConfig | None = None, tool_client=None, tool_schemas: list[dict] | None = None,
                 adapter: AdapterSpec | None = None, fp32_head: bool = False, return_routing: bool = False,
                 cpus_key: str = "rollout.cpus_per_engine"):
        """Placed by `place_engines` (colocated: in the training ranks' bundles; separate: their own).
        `loops`: the agent loops the engines run, by name; `tool_client` (`ToolPool.client()`) the
        tool workers their loops call; `adapter`: the engines serve the policy's LoRA adapter over the
        base model, which they load once and keep (no memory release); `fp32_head`: the engines compute logits
        in fp32 (`model.fp32_lm_head`); `return_routing`: trajectories carry their MoE routing (R3);
        `cpus_key`: the setting that gave the engines their CPUs, named when they do not fit."""
        super().__init__([actor_name("rollout", i) for i in range(cfg.num_engines)])
        self.cfg = cfg
        keep_key = None if return_routing else engine_keep_key(cfg, train_placement, gpu_share)
        kept = self.take_kept("rollout", keep_key)  # not engines whose routing capture (R3) set up their process
        if not kept:
            self.placement = place_engines(cfg, train_placement, train_cpus, gpu_share, "rollout engines", cpus_key)
        self.releases_memory = cfg.placement == "colocated" and cfg.free_memory_in_update and adapter is None
        self.spec = RolloutWorkerSpec(model_path, cfg, seed, self.placement.threads, self.releases_memory, loops, tools,
                                      tool_client, tool_schemas, adapter, fp32_head, return_routing)
        """Every engine's spec but its seed (`spec_of`)."""
        try:
            if kept:
                self.reuse_kept(lambda i: (self.spec_of(i),))
            else:
                self.start_engines(model_path)
            self.call_limit = CallLimit(cfg.timeout_s, "rollout.timeout_s")  # for calls, not for starting
        except BaseException:
            self.shutdown()
            raise

    def spec_of(self, index: int) -> RolloutWorkerSpec:
        return replace(self.spec, seed=engine_seed(self.spec.seed, index))

    def _spawn(self, index: int):
        seat = self.placement.seat(index)
        return spawn(ray.remote(RolloutWorker), "rollout", index, self.spec_of(index), env={**ENGINE_ENV, **seat.env},
                     num_cpus=seat.num_cpus, num_gpus=seat.num_gpus, scheduling_strategy=seat.strategy)

    def rollout(self, prompts: list[tuple[int, list[int], dict]], loop: str, n: int, sampling: Sampling,
                seed: int, version: int | None = None) -> tuple[list[Trajectory], dict[str, float]]:
        """`n` trajectories of each (prompt_index, prompt_ids, row) by the agent loop `loop`,
        the prompts split across engines in contiguous shares; returns them in prompt order, with the
        slowest engine's rollout and engine-step seconds. With `version`, every engine must hold the
        weights (or adapter) of that version. An engine that dies is replaced (`wait_replacing`) and
        its share generated again with the same seeds."""
        engines = len(self.actors)
        shares = contiguous_shares(prompts, engines)
        busy = [i for i in range(engines) if shares[i]]
        calls = [self.submit_call(i, RolloutWorker.rollout, shares[i], loop, n, sampling, seed, version) for i in busy]
        prompt_ids = {index: ids for index, ids, _ in prompts}
        results = self.wait_replacing(calls)
        stats = {name: max(result.stats.get(name, 0.0) for result in results) for name in ("rollout_s", "engine_s")}
        return [t for result in results for t in result.unpack(prompt_ids)], stats

    def sampling(self, temperature: float | None = None, max_new_tokens: int | None = None) -> Sampling:
        """The rollout's sampling, with another temperature or turn budget (validation's)."""
        cfg = self.cfg
        turn = max_new_tokens or cfg.max_new_tokens
        return Sampling(cfg.temperature if temperature is None else temperature, cfg.top_p, turn,
                        max(cfg.response_budget, turn), tuple(cfg.stop))

    def release_memory(self) -> int | None:
        """The trainer's turn: colocated engines free their weights (and KV cache, on GPU); the
        bytes freed (None when the engines keep their memory)."""
        if self.releases_memory:
            calls = [self.submit_call(i, RolloutWorker.release_memory) for i in range(len(self.actors))]
            return sum(self.wait_replacing(calls))
        return None

