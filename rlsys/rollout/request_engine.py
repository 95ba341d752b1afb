"""vLLM's in-process engine served request by request, to coroutines.

An agent loop is one coroutine per trajectory: it awaits `generate(prompt_ids, params)`
for each model turn and, between turns, its tools. `RequestEngine` keeps one in-process
vLLM engine (the offline `LLM`'s engine, driven step by step: no engine-core process) busy
with every request its coroutines have submitted. Each round it adds what was submitted
since the last one, in submission order, runs one engine step, and hands every finished
request its completion. The step runs on the event loop's thread: a coroutine's own work
between turns (parsing a tool call, submitting its next turn) waits at most one step, and
the engine is never touched from two threads.

Requests submitted together are added together, in order, as `LLM.generate` adds a batch:
a batch of single-turn requests samples exactly what `LLM.generate` samples (the same
per-request seeds, the same steps).

New weights may arrive while requests are in flight (asynchronous RL): `weights_changed`
labels every token sampled from then on with the new version and makes the running requests
recompute their KV cache under the new weights before their next token (vLLM preempts
them; their sampled tokens stay). Nothing sampled is lost or sampled twice, and each token's
completion says which weights sampled it. A sync's weights arrive in one call or several
(buckets); the engine takes no step between its first and its last.

A request the engine refuses (too long for it, parameters it cannot take) fails alone, with
`RequestRejected` and vLLM's reason; the others go on.

A request may be streamed (`on_tokens`): after each engine step its tokens so far reach the
callback, for the OpenAI endpoint's `stream: true`; it samples what it would unstreamed.

`schedule` records the order of what decided the engine's tokens (the requests each step added,
the step before which each sync landed), or follows a record so that a run repeats one whose
timing differed (`rlsys.rollout.schedule`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import numpy as np

from rlsys.config.loader import first_line
from rlsys.rollout.schedule import POLL_S, EngineSchedule, ScheduleDiverged, request_key
from rlsys.rollout.vllm_compat import TokenVersions

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Completion:
    """One finished request: the sampled tokens and the engine's log-prob of each."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    """"stop" (EOS or a stop string), "length" (the request's max_tokens), or "abort"."""
    versions: list[int]
    """The weight version that sampled each token."""
    routing: np.ndarray | None = None
    """[prompt + sampled tokens - 1, hidden layers, k]: the experts an MoE model routed each token it
    computed to (the last sampled token is never computed), when the engine returns them (R3)."""


@dataclass(frozen=True)
class Request:
    """One sample to generate: prompt token ids, vLLM `SamplingParams`, the prompt's pictures."""

    prompt_ids: list[int]
    params: object
    images: list | None = None
    on_tokens: Callable[[list[int]], None] | None = None
    """Called after each engine step with the tokens sampled so far (a streamed request)."""


class RequestRejected(ValueError):
    """vLLM refused one request (its reason follows); the engine serves the others."""


class EngineClosed(RuntimeError):
    """A request reached an engine that `close` stopped."""


class RequestEngine:
    def __init__(self, llm):
        self.llm = llm
        self._submitted: list[tuple[str, Request, asyncio.Future]] = []
        """(schedule key, request, future) of each request not yet added."""
        self._running: dict[str, list[asyncio.Future]] = {}
        """Each request's waiting samples, in sample order."""
        self._streamed: dict[str, Callable[[list[int]], None]] = {}
        """Each streamed request's `on_tokens`."""
        self._serving: asyncio.Task | None = None
        self._ids = itertools.count()
        self.step_s = 0.0
        """Seconds spent in engine steps, all told (the rest of a rollout is its loops and tools)."""
        self.version = 0
        self._versions = TokenVersions(llm.llm_engine)
        self.lora_request = None
        """The LoRA adapter every request is generated with (`rlsys.rollout.adapters`), or None."""
        self.schedule = EngineSchedule()
        self._syncing = False
        """Between a sync's first bucket and its last: no step runs on half-written weights."""
        self._closed = False

    async def generate(self, prompt_ids: list[int], params, images: list | None = None,
                       on_tokens: Callable[[list[int]], None] | None = None) -> Completion:
        """Sample one completion of `prompt_ids` with vLLM `SamplingParams` (n=1, flat log-probs
        of the sampled token: `logprobs=0, flat_logprobs=True`). `images`: a vision-language
        model's pictures, one for each image pad in `prompt_ids` (vLLM expands each pad).
        `on_tokens`: called after each engine step with the tokens sampled so far."""
        if self._closed:
            raise EngineClosed("rollout engine: this engine was released; its group has ended")
        future = asyncio.get_running_loop().create_future()
        request = Request(prompt_ids, params, images or None, on_tokens)
        key = request_key(prompt_ids, params, images) if self.schedule.active else ""
        self._submitted.append((key, request, future))
        if self._serving is None or self._serving.done():
            self._serving = asyncio.create_task(self._serve())
        return await future

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt and sampled tokens) the engine takes."""
        return self.llm.llm_engine.model_config.max_model_len

    @property
    def busy(self) -> bool:
        return bool(self._submitted or self._running)

    async def sync_turn(self) -> None:
        """Called before a sync writes its first weight: wait for the engine step the schedule
        followed puts it before, then hold the engine's steps until `weights_changed` (or
        `sync_failed`)."""
        await self.schedule.wait_for_sync()
        self._syncing = True

    def sync_failed(self) -> None:
        """A sync's call failed between its first weight and its last: let the engine go on (its
        error reaches the trainer, which restarts or stops)."""
        self._syncing = False

    def weights_changed(self, version: int) -> None:
        """New weights are in place: label what is sampled from now on `version`, and have the
        requests in flight recompute their KV cache, computed under the old weights, and a
        vision-language model's pictures their features (vLLM keeps a picture's encoder output by its
        hash, across requests)."""
        self._syncing = False
        self.schedule.synced(version)
        self.version = version
        self._versions.changed(version)
        self.llm.llm_engine.reset_prefix_cache(reset_running_requests=bool(self._running))
        if self.llm.llm_engine.model_config.is_multimodal_model:
            self.llm.llm_engine.reset_encoder_cache()

    async def close(self) -> None:
        """Serve no more: the requests in flight fail with `EngineClosed` (their group has ended and
        nobody waits for them) and the serving task has ended when this returns, so the vLLM engine
        can be shut down with no step of it still to come."""
        self._closed = True
        if self._serving is not None and not self._serving.done():
            self._serving.cancel()
            try:
                await self._serving
            except (asyncio.CancelledError, EngineClosed):
                pass

    async def _serve(self) -> None:
        """Add what was submitted, step, resolve the finished requests; until nothing is left."""
        try:
            while self.busy:
                await asyncio.sleep(0)  # every coroutine that can submit now does, before the step
                await self.schedule.wait_for_step(lambda: [key for key, *_ in self._submitted])
                while self._syncing:
                    await asyncio.sleep(POLL_S)
                self._add_submitted()
                if not self._running and not self._submitted:  # each request added was refused
                    continue
                if not self._running:
                    raise ScheduleDiverged(f"engine step {self.schedule.step}: the requests waiting are recorded "
                                           f"for later steps, and none is running")
                started = time.perf_counter()
                outputs = self.llm.llm_engine.step()
                self.step_s += time.perf_counter() - started
                self.schedule.stepped()
                for output in outputs:
                    if output.finished:
                        self._streamed.pop(output.request_id, None)
                        for future, sampled in zip(self._running.pop(output.request_id), output.outputs):
                            if not future.done():  # a caller that gave up (cancelled) takes nothing
                                future.set_result(_completion(sampled, self._versions.finished(output.request_id,
                                                                                               sampled)))
                        self._versions.done(output.request_id)
                    elif output.request_id in self._streamed:
                        self._stream(output.request_id, list(output.outputs[0].token_ids))
        except BaseException as err:  # the engine failed or was closed: every waiting coroutine gets the error
            self.schedule.failed = err
            failure = EngineClosed("rollout engine: this engine was released; its group has ended") \
                if self._closed else err
            for future in [*(f for futures in self._running.values() for f in futures),
                           *(f for *_, f in self._submitted)]:
                if not future.done():
                    future.set_exception(failure)
            self._running.clear()
            self._streamed.clear()
            self._submitted.clear()
            raise

    def _stream(self, request_id: str, token_ids: list[int]) -> None:
        """Hand a streamed request its tokens so far; a callback that fails is dropped (its request goes
        on, unstreamed), never the engine."""
        try:
            self._streamed[request_id](token_ids)
        except Exception:
            log.exception("a streamed request's callback failed; the request goes on without it")
            del self._streamed[request_id]

    def _add_submitted(self) -> None:
        """Add the submitted requests in order. A run of requests for the same prompt with the same
        parameters and consecutive seeds (a prompt's samples, submitted one after another) goes in as
        one request of that many samples: vLLM samples its i-th with the first seed + i, exactly what
        the separate requests would sample, and processes the prompt once instead of once a sample."""
        from vllm import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        due = self.schedule.due([key for key, *_ in self._submitted])
        submitted = self._take_submitted(due)
        self.schedule.added(due)
        for request, futures in _runs(submitted):
            request_id = f"rlsys-{next(self._ids)}"
            try:  # vLLM checks the parameters as they are built: a refusal is this request's alone
                params = msgspec.structs.replace(request.params, n=len(futures))
            except Exception as err:
                self._reject(request_id, futures, len(request.prompt_ids), err)
                continue
            # the finished request only, as LLM.generate asks; a streamed one after every step
            params.output_kind = RequestOutputKind.CUMULATIVE if request.on_tokens else RequestOutputKind.FINAL_ONLY
            if request.on_tokens:
                self._streamed[request_id] = request.on_tokens
            prompt = TokensPrompt(prompt_token_ids=request.prompt_ids)
            if request.images:
                prompt["multi_modal_data"] = {"image": request.images}
            try:
                self.llm.llm_engine.add_request(request_id, prompt, params, lora_request=self.lora_request)
            except Exception as err:  # this request's own fault: its samples fail, the engine goes on
                self._reject(request_id, futures, len(request.prompt_ids), err)
                continue
            self._running[request_id] = futures
            self._versions.added(request_id, self.version)

    def _reject(self, request_id: str, futures: list[asyncio.Future], prompt_tokens: int, err: Exception) -> None:
        reason = first_line(err)
        log.warning("rollout engine: refused a request of %d prompt tokens: %s", prompt_tokens, reason)
        self._streamed.pop(request_id, None)
        for future in futures:
            if not future.done():
                future.set_exception(RequestRejected(f"the engine refused the request: {reason}"))

    def _take_submitted(self, keys: list[str]) -> list[tuple[Request, asyncio.Future]]:
        """The waiting requests named `keys`, in that order, removed from the waiting list; of several
        with one name (they sample alike), the first to arrive."""
        waiting: dict[str, list[int]] = {}
        for index, (key, *_) in enumerate(self._submitted):
            waiting.setdefault(key, []).append(index)
        chosen = [waiting[key].pop(0) for key in keys]
        taken = [self._submitted[index][1:] for index in chosen]
        left = set(range(len(self._submitted))) - set(chosen)
        self._submitted = [entry for index, entry in enumerate(self._submitted) if index in left]
        return taken


GREEDY_TEMPERATURE = 1e-5
"""Below this temperature vLLM decodes greedily, and refuses a request of more than one sample."""


def _runs(submitted: list[tuple[Request, asyncio.Future]]) -> list[tuple[Request, list[asyncio.Future]]]:
    """Consecutive requests with the same prompt, images and parameters but for seeds first, first + 1, ...
    (none streamed, none greedy: two samples of one group whose histories a harness rewrote alike may ask
    the same greedy summary)."""
    runs: list[tuple[Request, list[asyncio.Future]]] = []
    for request, future in submitted:
        if runs and _continues(runs[-1], request):
            runs[-1][1].append(future)
        else:
            runs.append((request, [future]))
    return runs


def _continues(run: tuple[Request, list[asyncio.Future]], request: Request) -> bool:
    first, futures = run
    params, run_params = request.params, first.params
    if params.seed is None or run_params.seed is None or params.n != 1 or request.prompt_ids != first.prompt_ids \
            or request.images is not first.images or request.on_tokens or first.on_tokens \
            or params.temperature < GREEDY_TEMPERATURE:
        return False
    return params.seed == run_params.seed + len(futures) and msgspec.structs.replace(params, seed=run_params.seed) \
        == run_params


def _completion(sampled, versions: list[int]) -> Completion:
    logprobs = list(sampled.logprobs.logprobs) if sampled.logprobs is not None else []
    return Completion(list(sampled.token_ids), logprobs, sampled.finish_reason or "", versions,
                      getattr(sampled, "routed_experts", None))
