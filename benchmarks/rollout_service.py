"""The rollout engine served request by request against vLLM's offline batch `generate`,
side by side in one process on the same engine, and against vLLM's `AsyncLLM` (a separate
engine-core process) on the same work.

    .venv/bin/python benchmarks/rollout_service.py --model runs/arith/sft/hf_model \\
        --data runs/arith/data/rl_train.parquet --prompts 64 --n 8 --max-new-tokens 8 --rounds 6

Each round generates one RL step's requests (the first `--prompts` prompts, `--n` samples
each, T=1, per-request seeds as the rollout worker sets them) three ways, in alternating
order: `LLM.generate` over the whole batch (one request with n samples per prompt), the
`RequestEngine` (one coroutine and one request per sample, as the agent loops submit them),
and `AsyncLLM` (one request per sample). It prints the generated tokens/s of each over the
rounds after a warm-up round, the per-round ratios of each to the batch (the same requests
and seeds in a round), and checks that the request engine sampled exactly what the batch did.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time


def requests(args, tokenizer):
    from rlsys.data.rl import load_prompts

    prompts, _ = load_prompts([args.data], tokenizer)
    return [(i, prompts[i].ids) for i in range(args.prompts)]


def sampling(n: int, seed: int, max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, detokenize=False, logprobs=0,
                          flat_logprobs=True, seed=seed)


def offline(llm, prompts, args, round_seed: int):
    from vllm import TokensPrompt

    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for _, ids in prompts],
                           [sampling(args.n, round_seed * 1_000_003 + i, args.max_new_tokens) for i, _ in prompts],
                           use_tqdm=False)
    return [(list(c.token_ids), list(c.logprobs.logprobs)) for o in outputs for c in o.outputs]


def by_request(engine, prompts, args, round_seed: int, loop):
    """One coroutine and one request per sample, on a long-lived event loop (as in the rollout actor)."""
    async def all_samples():
        return await asyncio.gather(*(
            engine.generate(ids, sampling(1, round_seed * 1_000_003 + i + j, args.max_new_tokens))
            for i, ids in prompts for j in range(args.n)))

    return [(c.token_ids, c.logprobs) for c in loop.run_until_complete(all_samples())]


def with_async_llm(async_llm, prompts, args, round_seed: int, loop):
    from vllm import TokensPrompt

    async def one(request_id: str, ids, params):
        final = None
        async for output in async_llm.generate(TokensPrompt(prompt_token_ids=ids), params, request_id):
            final = output
        [sampled] = final.outputs
        return list(sampled.token_ids), list(sampled.logprobs.logprobs)

    async def all_samples():
        return await asyncio.gather(*(
            one(f"{round_seed}-{i}-{j}", ids, sampling(1, round_seed * 1_000_003 + i + j, args.max_new_tokens))
            for i, ids in prompts for j in range(args.n)))

    return loop.run_until_complete(all_samples())


def timed(fn, *args):
    started = time.perf_counter()
    samples = fn(*args)
    return time.perf_counter() - started, samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--skip-async-llm", action="store_true")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from rlsys.config.rollout import RolloutConfig
    from rlsys.rollout.request_engine import RequestEngine
    from rlsys.rollout.vllm_engine import create_llm

    prompts = requests(args, AutoTokenizer.from_pretrained(args.model))
    cfg = RolloutConfig(engine_memory_gib=0.25)
    llm = create_llm(args.model, cfg, seed=0)
    engine, engine_loop = RequestEngine(llm), asyncio.new_event_loop()
    ways = {"offline generate": lambda seed: offline(llm, prompts, args, seed),
            "request engine": lambda seed: by_request(engine, prompts, args, seed, engine_loop)}
    if not args.skip_async_llm:
        async_llm, loop = start_async_llm(args.model, cfg)
        ways["AsyncLLM"] = lambda seed: with_async_llm(async_llm, prompts, args, seed, loop)
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    tokens: dict[str, list[int]] = {name: [] for name in ways}
    worst_gap = 0.0
    for round_index in range(args.rounds + 1):
        names = list(ways) if round_index % 2 else list(reversed(ways))
        results = {}
        for name in names:
            elapsed, results[name] = timed(ways[name], round_index)
            if round_index:  # round 0 warms up
                seconds[name].append(elapsed)
                tokens[name].append(sum(len(ids) for ids, _ in results[name]))
        batch, served = results["offline generate"], results["request engine"]
        assert [ids for ids, _ in batch] == [ids for ids, _ in served], "the request engine sampled other tokens"
        worst_gap = max(worst_gap, max(abs(a - b) for (_, x), (_, y) in zip(batch, served) for a, b in zip(x, y)))
    print(f"{args.prompts} prompts x {args.n} samples, <= {args.max_new_tokens} new tokens, {args.rounds} rounds "
          "(tokens/s of all rounds; against offline generate: the median and range of the per-round ratios):")
    base = seconds["offline generate"]
    for name in ways:
        ratios = sorted(b / t for b, t in zip(base, seconds[name]))
        print(f"  {name:16s} {sum(tokens[name]) / sum(seconds[name]):9.0f} tokens/s  "
              f"{statistics.median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f})")
    print(f"  request engine vs offline generate: identical tokens; largest log-prob difference {worst_gap:.1e}")


def start_async_llm(model: str, cfg):
    """vLLM's AsyncLLM with the rollout engine's settings (its engine core in a process of its own)."""
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    engine_args = AsyncEngineArgs(model=model, dtype="float32", enforce_eager=True,
                                  kv_cache_memory_bytes=int(cfg.engine_memory_gib * 2**30),
                                  enable_chunked_prefill=False, logprobs_mode="processed_logprobs", seed=0)
    loop = asyncio.new_event_loop()
    return AsyncLLM.from_engine_args(engine_args), loop


if __name__ == "__main__":
    main()
