"""One rollout engine: vLLM inside a Ray actor, generating samples and taking
new weights from the trainer bucket by bucket."""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import numpy as np
import torch

from rlsys.config.schema import RolloutConfig
from rlsys.console import redirect_actor_output
from rlsys.host_memory import releases_freed_memory
from rlsys.rollout.engine_memory import WEIGHTS, EngineMemory, record_loaded
from rlsys.rollout.vllm_engine import cpu_thread_binding, create_llm
from rlsys.rollout.vllm_plugin import keep_cpu_weights_live
from rlsys.sync.placement import WeightPlacer
from rlsys.sync.shards import Pieces, ShardBucket, Shared, shard_pieces, shared_pieces


@dataclass
class Sample:
    """One generated response."""

    prompt_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    """The engine's log-prob of each response token under the weights it sampled with."""
    text: str
    """The response tokens decoded (special tokens skipped): what the reward scores is what is trained on."""
    finish_reason: str


def vllm_requests(prompts: list[tuple[int, list[int]]], n: int, temperature: float, top_p: float,
                  max_new_tokens: int, seed: int, stop: list[str]) -> tuple[list, list]:
    """vLLM prompts and sampling parameters for `RolloutWorker.generate`: each request's seed
    comes from `seed` and its prompt index. vLLM detokenizes only to find stop strings (its
    token-by-token detokenization, and the decoding of every log-prob's token, are a large
    share of a short rollout); `RolloutWorker.generate` decodes the responses in one batch instead.
    Log-probs come flat (a few lists per response, not a dict per token)."""
    from vllm import SamplingParams, TokensPrompt

    requests = [TokensPrompt(prompt_token_ids=ids) for _, ids in prompts]
    params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_new_tokens,
                             stop=stop or None, detokenize=bool(stop), logprobs=0, flat_logprobs=True,
                             seed=seed * 1_000_003 + index)
              for index, _ in prompts]
    return requests, params


@dataclass
class Generated:
    """One engine's samples as columns, in request order: Ray sends a few arrays far faster
    than as many small objects as samples."""

    prompt_index: np.ndarray
    lengths: np.ndarray
    """Response tokens of each sample."""
    response_ids: np.ndarray
    """All samples' response tokens, back to back."""
    logprobs: np.ndarray
    """The engine's log-prob of each of those tokens."""
    texts: list[str]
    finish_reasons: list[str]

    def samples(self, prompt_ids: dict[int, list[int]]) -> list[Sample]:
        """One `Sample` per response; `prompt_ids`: the ids of each prompt index."""
        ends = np.cumsum(self.lengths).tolist()
        starts = [0, *ends[:-1]]
        ids, logprobs = self.response_ids.tolist(), self.logprobs.tolist()
        return [Sample(index, prompt_ids[index], ids[start:end], logprobs[start:end], text, finish)
                for index, start, end, text, finish in zip(self.prompt_index.tolist(), starts, ends, self.texts,
                                                           self.finish_reasons)]


def _place_weights(worker, buckets: list[ShardBucket | None]) -> None:
    """Runs inside each vLLM worker: write one bucket, given as every training rank's shards,
    into the engine's parameters (`rlsys.sync.placement`)."""
    _place(worker, shard_pieces(buckets))


def _place_shared(worker, shards_by_rank: list[list[Shared]]) -> None:
    """Runs inside each vLLM worker: write every weight, read in place from the training ranks'
    memory (mapped on the first sync, whose handles are the only ones sent)."""
    if not hasattr(worker, "rlsys_shared"):
        worker.rlsys_shared = shared_pieces(shards_by_rank)
    _place(worker, worker.rlsys_shared)
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the trainer's next step rewrites the shards these copies read


def _place(worker, pieces: Pieces) -> None:
    if not hasattr(worker, "rlsys_placer"):
        worker.rlsys_placer = WeightPlacer(worker.model_runner.get_model())
    record_loaded(worker, worker.rlsys_placer(pieces))


def _release_staging(worker) -> None:
    if hasattr(worker, "rlsys_placer"):
        worker.rlsys_placer.release()


class RolloutWorker:
    def __init__(self, model_path: str, cfg: RolloutConfig, seed: int, num_threads: int,
                 releases_memory: bool = False):
        redirect_actor_output()
        torch.set_num_threads(num_threads)
        on_gpu = torch.cuda.is_available()
        if not on_gpu:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND",
                                  cpu_thread_binding(num_threads, cfg.tensor_parallel_size))
            keep_cpu_weights_live()  # the plugin does it too, where rlsys is installed
        self.cfg = cfg
        self.llm = create_llm(model_path, cfg, seed, sleep_mode=releases_memory and on_gpu)
        self.memory = EngineMemory(self.llm, on_gpu)

    @releases_freed_memory
    def generate(self, prompts: list[tuple[int, list[int]]], n: int, temperature: float, top_p: float,
                 max_new_tokens: int, seed: int) -> Generated:
        """Sample `n` responses for each (prompt_index, prompt_ids). The seed of
        each request is derived from `seed` and the prompt index, so the same
        step of a resumed run samples the same responses."""
        self.memory.ready_to_generate()
        requests, params = vllm_requests(prompts, n, temperature, top_p, max_new_tokens, seed, self.cfg.stop)
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        completions = [(index, c) for (index, _), output in zip(prompts, outputs) for c in output.outputs]
        token_ids = [c.token_ids for _, c in completions]
        response_ids = np.fromiter(itertools.chain.from_iterable(token_ids), dtype=np.int64)
        # flat log-probs, one per token with logprobs=0: the sampled token's
        logprobs = np.fromiter(itertools.chain.from_iterable(c.logprobs.logprobs for _, c in completions),
                               dtype=np.float32)
        if len(logprobs) != len(response_ids):
            raise RuntimeError(f"rollout engine: vLLM returned {len(logprobs)} log-probs for {len(response_ids)} "
                               "tokens; expected the sampled token's alone")
        return Generated(np.array([index for index, _ in completions], dtype=np.int64),
                         np.array([len(ids) for ids in token_ids], dtype=np.int64), response_ids, logprobs,
                         self._decode(token_ids), [c.finish_reason or "" for _, c in completions])

    def _decode(self, token_ids: list[list[int]]) -> list[str]:
        """Each response's text (special tokens skipped), decoding each distinct response once:
        a converging policy repeats its answers (an arithmetic step: 512 samples, few distinct)."""
        distinct = list(dict.fromkeys(map(tuple, token_ids)))
        texts = dict(zip(distinct, self.llm.get_tokenizer().batch_decode(list(map(list, distinct)),
                                                                          skip_special_tokens=True)))
        return [texts[tuple(ids)] for ids in token_ids]

    @releases_freed_memory
    def load_weights(self, *buckets: ShardBucket | None, first: bool = False, last: bool = False) -> None:
        """Load one bucket, given as every training rank's shards of it. The sync's first
        bucket allocates released weights again; its last checks that every weight freed was
        rewritten and drops the prefix cache, computed under the old weights (here rather than
        in calls of their own, which would add two round trips to every sync)."""
        self._load(_place_weights, list(buckets), first, last)

    def load_shared(self, *shards_by_rank: list[Shared]) -> None:
        """Load every weight, read in place from the memory of the training ranks on this
        machine (`WeightSync`'s in-place path): one call per sync, nothing through the object store.
        The first sync brings every rank's handles; later ones bring none (the handles never
        change and the engine keeps their mapping). Frees nothing, so no trim after it."""
        self._load(_place_shared, list(shards_by_rank), first=True, last=True)

    def _load(self, place, shards: list, first: bool, last: bool) -> None:
        """Run `place` on `shards` in every vLLM worker, inside a sync's first and last steps."""
        if first:
            self.memory.resume(WEIGHTS)
        self.llm.collective_rpc(place, args=(shards,))
        if last:
            self.memory.confirm_rewritten()
            self.llm.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop vLLM's engine: with tensor-parallel workers its executor unlinks their
        shared-memory queues, which a killed actor leaves in /dev/shm."""
        self.llm.llm_engine.engine_core.shutdown()

    @releases_freed_memory
    def release_memory(self) -> int:
        """Free the weights, the KV cache (on GPU) and the sync's staging buffer for the
        colocated trainer (see `engine_memory`); returns the bytes of weights and KV cache freed."""
        self.llm.collective_rpc(_release_staging)
        return self.memory.release()
