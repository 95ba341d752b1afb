"""RLVR benchmark: a fixed workload, per-phase times, and rollout throughput
beside bare vLLM `generate` of the same requests, measured in the same run.

    .venv/bin/python benchmarks/rlvr_bench.py --model runs/arith/sft/hf_model \\
        --data runs/arith/data/rl_train.parquet --steps 8 [--dp 2] [config overrides, e.g. parallel.tp=2]

Prints a table of mean phase times over the measured steps (the first step
is warm-up and excluded), the rollout phase's generated tokens/s against a
bare in-process vLLM engine replaying the same requests (each step's prompts
and per-request sampling parameters, seeds included), and the weight-sync time
as a fraction of the step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import ray

from rlsys.config.loader import load_config
from rlsys.config.schema import RLJobConfig

PHASES = ("generate", "reward", "old_logprob", "reference", "update", "sync")


def bench_config(args, extra: list[str] = ()) -> RLJobConfig:
    overrides = [
        f"output_dir={args.out}", f"model.path={args.model}", f"data.train_files=[{args.data}]",
        f"rollout.n={args.n}", f"rollout.max_new_tokens={args.max_new_tokens}", "rollout.engine_memory_gib=0.25",
        f"train.steps={args.steps}", f"train.prompts_per_step={args.prompts}", "train.micro_batch_size=128",
        "train.save_every=0", "train.resume=false", f"parallel.dp_shard={args.dp}", "ray.include_dashboard=false",
        "tracking.backends=[jsonl]", f"algorithm.kl_coef={args.kl_coef}", *extra,
    ]
    return load_config(RLJobConfig, None, overrides)


def rlsys_steps(cfg: RLJobConfig, replay_beside_actors: bool = False
                ) -> tuple[list[dict], list, list[tuple], tuple[int, float] | None]:
    """Run the steps; returns their metrics, the first step's prompts, the arguments of every
    rollout call (RolloutGroup.generate), for a bare engine to replay, and with
    `replay_beside_actors` that replay run in this process while rlsys's actors are still up,
    idle (`bare_vllm_replay`)."""
    from rlsys.trainers.rl_trainer import RLVRTrainer

    trainer = RLVRTrainer(cfg)
    calls = []
    generate = trainer.rollout.generate

    def recorded(*args):
        calls.append(args)
        return generate(*args)

    trainer.rollout.generate = recorded
    try:
        rows = [trainer.step(step) for step in range(1, cfg.train.steps + 1)]
        prompts = [(i, trainer.prompts[i].ids) for i in range(cfg.train.prompts_per_step)]
        beside_actors = bare_vllm_replay(cfg, calls) if replay_beside_actors else None
    finally:
        trainer.shutdown()
    return rows, prompts, calls, beside_actors


def bare_vllm_generate(cfg: RLJobConfig, prompts, repeats: int) -> tuple[float, list]:
    """The same prompts and sampling parameters through a plain in-process vLLM engine:
    the median time of `repeats` generations after a warm-up, and the last outputs."""
    from vllm import SamplingParams, TokensPrompt

    from rlsys.rollout.vllm_engine import create_llm

    llm = create_llm(cfg.model.path, cfg.rollout, cfg.seed)
    requests = [TokensPrompt(prompt_token_ids=ids) for _, ids in prompts]
    params = SamplingParams(n=cfg.rollout.n, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                            max_tokens=cfg.rollout.max_new_tokens, logprobs=0, seed=cfg.seed,
                            detokenize=False)  # token ids only, as the rollout asks for them
    llm.generate(requests, params, use_tqdm=False)  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        outputs = llm.generate(requests, params, use_tqdm=False)
        times.append(time.perf_counter() - started)
    del llm
    return statistics.median(times), outputs


def bare_vllm_replay(cfg: RLJobConfig, calls: list[tuple]) -> tuple[int, float]:
    """Each step's rollout again, through a plain in-process vLLM engine: the same prompts and
    per-request sampling parameters (seeds included), each from an empty prefix cache as after
    a sync. The first call warms the engine up and is not counted, as the first step is not.
    Returns (generated tokens, seconds)."""
    from rlsys.actors.rollout_worker import vllm_requests
    from rlsys.rollout.vllm_engine import create_llm

    llm = create_llm(cfg.model.path, cfg.rollout, cfg.seed)
    tokens, seconds = 0, 0.0
    for index, (prompts, seed, n, temperature, max_new_tokens) in enumerate(calls):
        requests, params = vllm_requests(prompts, n, temperature, cfg.rollout.top_p, max_new_tokens, seed,
                                         cfg.rollout.stop)
        llm.reset_prefix_cache()
        started = time.perf_counter()
        outputs = llm.generate(requests, params, use_tqdm=False)
        if index:
            seconds += time.perf_counter() - started
            tokens += sum(len(c.token_ids) for o in outputs for c in o.outputs)
    del llm
    return tokens, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="runs/arith/sft/hf_model")
    parser.add_argument("--data", default="runs/arith/data/rl_train.parquet")
    parser.add_argument("--out", default="runs/bench/rlvr")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--dp", type=int, default=1, help="data-parallel training ranks (each gets cores / dp)")
    parser.add_argument("--kl-coef", type=float, default=0.0)
    parser.add_argument("overrides", nargs="*", help="rlsys config overrides (key=value)")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps: at least 2 (the first is warm-up)")
    os.makedirs(args.out, exist_ok=True)
    cfg = bench_config(args, args.overrides)

    rows, _, calls, (beside_tokens, beside_s) = rlsys_steps(cfg, replay_beside_actors=True)
    measured = rows[1:]
    mean = {k: statistics.mean(r[k] for r in measured) for k, v in measured[0].items() if isinstance(v, (int, float))}
    ray.shutdown()
    bare_tokens, bare_s = bare_vllm_replay(cfg, calls)
    rlsys_tokens = sum(r["throughput/generated_tokens_per_s"] * r["time/generate_s"] for r in measured)

    print(f"\nRLVR benchmark: {args.prompts} prompts x n={args.n}, <= {args.max_new_tokens} new tokens, "
          f"{args.dp} FSDP2 ranks, {len(measured)} measured steps (first step excluded)")
    print(f"{'phase':<14}{'mean s':>10}{'share':>9}")
    for phase in PHASES:
        key = f"time/{phase}_s"
        if key in mean:
            print(f"{phase:<14}{mean[key]:>10.3f}{mean[key] / mean['time/step_s']:>9.1%}")
    print(f"{'step':<14}{mean['time/step_s']:>10.3f}")
    rollout_rate = rlsys_tokens / sum(r["time/generate_s"] for r in measured)
    bare = bare_tokens / bare_s
    print(f"\nrollout generated tokens/s (rlsys, Ray actor):  {rollout_rate:,.0f} ({rlsys_tokens:,.0f} tokens)")
    print(f"bare vLLM generate tokens/s (the same requests): {bare:,.0f} ({bare_tokens:,} tokens)")
    print(f"ratio rlsys / bare vLLM:                         {rollout_rate / bare:.2f}")
    beside = beside_tokens / beside_s
    print(f"bare vLLM beside rlsys's idle Ray actors:        {beside:,.0f} tokens/s; rlsys / that: "
          f"{rollout_rate / beside:.2f}")
    print(f"weight sync: {mean['sync/time_s']:.3f} s = {mean['sync/time_s'] / mean['time/step_s']:.1%} of the step "
          f"({mean['sync/mb']:.1f} MB in {mean['sync/buckets']:.0f} buckets)")


if __name__ == "__main__":
    main()
