"""One rollout engine: vLLM inside an asynchronous Ray actor, serving an agent loop's requests
and taking new weights from the trainer.

`rollout` runs one agent loop (`rlsys.agents`) per trajectory, all of them concurrently in the
actor's event loop, over one in-process vLLM engine served request by request
(`RequestEngine`); tools run in the tool workers. The sync methods run on the event loop too,
between engine steps, never during one; a sync's first call waits for its turn (the engine step
a followed schedule puts it before) and holds the engine's steps until its last call.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import torch

from rlsys.actors.kept_actors import BuiltInPlace
from rlsys.agents.loop import AgentContext, AgentLoop
from rlsys.agents.trajectory import RolloutRequest, Sampling, Trajectories, Trajectory, dropped
from rlsys.config.rollout import RolloutConfig, ToolsConfig
from rlsys.console import StartupClock, record_startup, redirect_actor_output
from rlsys.host_memory import TRIM_ABOVE_BYTES, release_freed_memory, releases_freed_memory
from rlsys.models.lora import peft_name
from rlsys.models.moe import moe_family
from rlsys.rollout.adapters import AdapterSpec, ServedAdapter
from rlsys.rollout.cpu_experts import cpu_packed_experts, repack_written
from rlsys.rollout.engine_memory import WEIGHTS, EngineMemory, record_loaded
from rlsys.rollout.request_engine import RequestEngine, RequestRejected
from rlsys.rollout.vllm_engine import create_llm, free_stopped_engine, set_engine_threads, stop_engine
from rlsys.rollout.vllm_plugin import keep_cpu_weights_live
from rlsys.seeds import request_seed
from rlsys.sync.engine_writer import EngineWeightWriter
from rlsys.sync.gathered import BufferEntry, open_own_buffers
from rlsys.sync.shards import Assembler, Pieces, ShardBucket, Shared, shard_pieces, shared_pieces


def _place_weights(worker, buckets: list[ShardBucket | None]) -> None:
    """Runs inside each vLLM worker: write one bucket, given as every training rank's shards,
    into the engine's parameters (`rlsys.sync.engine_writer`)."""
    _place(worker, shard_pieces(buckets))


def _place_shared(worker, shards_by_rank: list[list[Shared]]) -> None:
    """Runs inside each vLLM worker: write every weight, read in place from the training ranks'
    memory (mapped on the first sync, whose handles are the only ones sent)."""
    if not hasattr(worker, "rlsys_shared"):
        worker.rlsys_shared = shared_pieces(shards_by_rank)
    _place(worker, worker.rlsys_shared)
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the trainer's next step rewrites the shards these copies read


async def _run(agent, request: RolloutRequest, sampling: Sampling) -> Trajectory:
    """The loop's trajectory of `request`; a sample whose request the engine refused is left out of the
    step, counted (`agent/dropped_rejected`; the reason is in the engine's log)."""
    try:
        return await agent.run(request, sampling)
    except RequestRejected:
        return dropped(request, "rejected")


def _place_gathered(worker, bucket: tuple[list[list[Shared]] | None, list[BufferEntry], int]) -> None:
    """Runs inside each vLLM worker: write one bucket of full tensors, read in place from the staging
    buffer the training rank on this worker's device gathered it into (`rlsys.sync.gathered`): (the
    handles of the buffers of the ranks beside the engine, sent once; the bucket's entries; the buffer)."""
    handles, entries, slot = bucket
    if handles is not None:
        worker.rlsys_gather_buffers = open_own_buffers(handles)
    buffer = worker.rlsys_gather_buffers[slot]
    _place(worker, dict((entry.name, [entry.piece(buffer)]) for entry in entries))
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the rank gathers a later bucket into this buffer


def _place(worker, pieces: Pieces) -> None:
    """Write `pieces` into the engine's parameters; then pack again the MoE experts they rewrote
    (on CPU, `rlsys.rollout.cpu_experts`), counted in `rlsys_repacked`."""
    if not hasattr(worker, "rlsys_writer"):
        model = worker.model_runner.get_model()
        family = moe_family(worker.model_runner.model_config.hf_config)
        worker.rlsys_writer = EngineWeightWriter(model, family.to_disk if family else None)
        worker.rlsys_packed_experts = cpu_packed_experts(model)
        worker.rlsys_repacked = 0
    written = worker.rlsys_writer(pieces)
    worker.rlsys_repacked += repack_written(worker.rlsys_packed_experts, written)
    record_loaded(worker, written)


def _release_staging(worker) -> None:
    if hasattr(worker, "rlsys_writer"):
        worker.rlsys_writer.release()


@dataclass(frozen=True)
class RolloutWorkerSpec:
    """Everything an engine needs to start: the model and its settings, the engine's seed and threads,
    and what its agent loops use."""

    model_path: str
    cfg: RolloutConfig
    seed: int
    num_threads: int
    releases_memory: bool = False
    """A colocated engine frees its memory while the trainer updates (`rollout.free_memory_in_update`)."""
    loops: dict[str, type[AgentLoop]] | None = None
    """The agent loop classes this engine runs, by the name `rollout` asks for."""
    tools: ToolsConfig | None = None
    tool_client: Any = None
    """`ToolPool.client()`: the tool workers the loops call."""
    tool_schemas: list[dict] | None = None
    adapter: AdapterSpec | None = None
    """Generate with the LoRA adapter each sync brings (`load_adapter`) over the base, loaded once."""
    fp32_head: bool = False
    """Logits in fp32 (`model.fp32_lm_head`)."""
    return_routing: bool = False
    """Trajectories carry the experts an MoE model routed their tokens to (`algorithm.router_replay: r3`)."""


class RolloutWorker(BuiltInPlace):
    def __init__(self, spec: RolloutWorkerSpec):
        redirect_actor_output()
        self._build(StartupClock(), False, spec)

    def _build(self, startup: StartupClock, reused: bool, spec: RolloutWorkerSpec) -> None:
        cfg = spec.cfg
        set_engine_threads(spec.num_threads, cfg.tensor_parallel_size)
        on_gpu = torch.cuda.is_available()
        keep_cpu_weights_live()  # the plugin does it too, where rlsys is installed
        self.cfg = cfg
        self.llm = create_llm(spec.model_path, cfg, spec.seed, sleep_mode=spec.releases_memory and on_gpu,
                              lora_rank=spec.adapter.rank if spec.adapter else 0, fp32_head=spec.fp32_head,
                              return_routing=spec.return_routing)
        self.memory = EngineMemory(self.llm, on_gpu)
        self.engine = RequestEngine(self.llm)
        self.adapter = ServedAdapter(self.llm, spec.adapter) if spec.adapter else None
        self.tokenizer = self.llm.get_tokenizer()
        context = AgentContext(self.engine, self.tokenizer, spec.tool_client, spec.tool_schemas or [],
                               spec.tools or ToolsConfig())
        self.loops = {name: cls(context) for name, cls in (spec.loops or {}).items()}
        record_startup("rollout", startup, reused)

    async def release(self) -> bool:
        """Stop the vLLM engine and drop it, keeping the process and its imports for an engine of
        another group (`reuse`; `rlsys.actors.kept_actors`). Requests still in flight (an asynchronous
        run's generation ahead, when its group ended) fail and the engine's serving task ends first: no
        step of the old engine may follow the shutdown, which tears down vLLM's process-wide parallel
        state that the next engine sets up again. An engine whose loops serve an endpoint (the OpenAI
        harness's) is not kept: False, and it is killed."""
        if any(hasattr(loop, "endpoint") for loop in self.loops.values()):
            return False
        await self.engine.close()
        self.shutdown()
        self.llm = self.engine = self.memory = self.adapter = self.tokenizer = None
        self.loops = {}
        free_stopped_engine()
        return True

    async def rollout(self, prompts: list[tuple[int, list[int], dict]], loop: str, n: int, sampling: Sampling,
                      seed: int, version: int | None = None) -> Trajectories:
        """`n` trajectories of each (prompt_index, prompt_ids, row) by the agent loop `loop`.
        The seed of each request comes from `seed`, the prompt index and the sample, so the same step of
        a resumed run samples the same responses (and a single-turn loop what `LLM.generate` with n
        samples per prompt samples)."""
        self.memory.ready_to_generate()
        if self.adapter is not None:
            self.adapter.check()
        if version is not None and version != self.engine.version:
            raise RuntimeError(f"rollout engine: it holds the policy of version {self.engine.version}, the trainer "
                               f"synced version {version}: a sync did not reach it")
        agent = self.loops[loop]
        requests = [RolloutRequest(index, ids, j, request_seed(seed, index, j), row)
                    for index, ids, row in prompts for j in range(n)]
        started, engine_before = time.perf_counter(), self.engine.step_s
        trajectories = await asyncio.gather(*(_run(agent, request, sampling) for request in requests))
        self._decode(trajectories)
        release_freed_memory(TRIM_ABOVE_BYTES)
        return Trajectories.of(trajectories, requests, {"rollout_s": time.perf_counter() - started,
                                                        "engine_s": self.engine.step_s - engine_before})

    def _decode(self, trajectories: list[Trajectory]) -> None:
        """Each response's text (special tokens skipped) where its loop left none, decoding each
        distinct response once: a converging policy repeats its answers."""
        undecoded = [t for t in trajectories if t.text is None]
        distinct = list(dict.fromkeys(tuple(t.response_ids) for t in undecoded))
        texts = dict(zip(distinct, self.tokenizer.batch_decode(list(map(list, distinct)), skip_special_tokens=True)))
        for trajectory in undecoded:
            trajectory.text = texts[tuple(trajectory.response_ids)]

    @releases_freed_memory
    async def load_weights(self, *buckets: ShardBucket | None, first: bool = False, last: bool = False,
                           version: int = 0) -> None:
        """Load one bucket, given as every training rank's shards of it. The sync's first
        bucket allocates released weights again; its last checks that every weight freed was
        rewritten and puts `version` in place (here rather than in calls of their own, which
        would add two round trips to every sync)."""
        if first:
            await self.engine.sync_turn()
        self._load(_place_weights, list(buckets), first, last, version)

    @releases_freed_memory
    async def load_gathered(self, handles: list[list[Shared]] | None, entries: list[BufferEntry], slot: int,
                            first: bool = False, last: bool = False, version: int = 0) -> None:
        """Load one bucket gathered by the training ranks, read in place from the buffer `slot` of the rank
        on each vLLM worker's device; `handles` (those ranks' buffers, one list per rank) come with the first
        bucket this engine reads. `first` and `last` as in `load_weights`."""
        if first:
            await self.engine.sync_turn()
        self._load(_place_gathered, (handles, entries, slot), first, last, version)

    async def load_shared(self, *shards_by_rank: list[Shared], version: int = 0) -> None:
        """Load every weight, read in place from the memory of the training ranks on this
        machine (`WeightSync`'s in-place path): one call per sync, nothing through the object store.
        The first sync brings every rank's handles; later ones bring none (the handles never
        change and the engine keeps their mapping). Frees nothing, so no trim after it."""
        await self.engine.sync_turn()
        self._load(_place_shared, list(shards_by_rank), True, True, version)

    def _load(self, place, payload, first: bool, last: bool, version: int) -> None:
        """Run `place` on `payload` (shards, or a gathered bucket) in every vLLM worker, inside a sync's
        first and last steps. In an asynchronous actor this runs between two engine steps: requests in
        flight go on under the new weights (`RequestEngine.weights_changed`)."""
        try:
            if first:
                self.memory.resume(WEIGHTS)
            self.llm.collective_rpc(place, args=(payload,))
            if last:
                self.memory.confirm_rewritten()
                self.engine.weights_changed(version)
        except BaseException:
            self.engine.sync_failed()
            raise

    async def load_adapter(self, *buckets: ShardBucket | None, version: int = 0) -> int:
        """Generate from now on with the LoRA adapter the training ranks' `buckets` hold, labelled
        `version`; returns its bytes."""
        await self.engine.sync_turn()
        try:
            tensors = {peft_name(name): tensor for name, tensor in Assembler()(shard_pieces(list(buckets))).items()}
            self.adapter.load(tensors, version)
            self.engine.lora_request = self.adapter.request
            self.engine.weights_changed(version)
        except BaseException:
            self.engine.sync_failed()
            raise
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def schedule(self) -> tuple[int, list[list]]:
        """The engine steps taken so far and the schedule events recorded since the last call
        (`rlsys.rollout.schedule`)."""
        return self.engine.schedule.step, self.engine.schedule.take()

    def follow_schedule(self, events: list[list], start: int) -> None:
        """Count engine steps from `start` (a resumed run's engine continues the count) and follow
        the recorded `events` from there (none: run by the clock)."""
        self.engine.schedule.follow(events, start)

    def shutdown(self) -> None:
        stop_engine(self.llm)

    @releases_freed_memory
    def release_memory(self) -> int:
        """Free the weights, the KV cache (on GPU) and the sync's staging buffer for the
        colocated trainer (see `engine_memory`); returns the bytes of weights and KV cache freed."""
        self.llm.collective_rpc(_release_staging)
        return self.memory.release()
