"""RLVR benchmark: a fixed workload, per-phase times, and rollout throughput
beside bare vLLM `generate` on the same prompts, measured in the same run.

    .venv/bin/python benchmarks/rlvr_bench.py --model runs/arith/sft/hf_model \\
        --data runs/arith/data/rl_train.parquet --steps 8

Prints a table of mean phase times over the measured steps (the first step
is warm-up and excluded), the rollout phase's generated tokens/s against a
bare in-process vLLM engine generating the same prompts with the same
sampling parameters, and the weight-sync time as a fraction of the step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

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


def rlsys_steps(cfg: RLJobConfig) -> tuple[list[dict], list]:
    from rlsys.trainers.rl_trainer import RLVRTrainer

    trainer = RLVRTrainer(cfg)
    try:
        rows = [trainer.step(step) for step in range(1, cfg.train.steps + 1)]
        prompts = [(i, trainer.prompt_ids[i]) for i in range(cfg.train.prompts_per_step)]
    finally:
        trainer.shutdown()
    return rows, prompts


def bare_vllm_generate(cfg: RLJobConfig, prompts, repeats: int) -> tuple[float, list]:
    """The same prompts and sampling parameters through a plain in-process vLLM engine:
    the median time of `repeats` generations after a warm-up, and the last outputs."""
    from vllm import SamplingParams, TokensPrompt

    from rlsys.rollout.vllm_engine import create_llm

    llm = create_llm(cfg.model.path, cfg.rollout.engine_memory_gib, cfg.seed)
    requests = [TokensPrompt(prompt_token_ids=ids) for _, ids in prompts]
    params = SamplingParams(n=cfg.rollout.n, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                            max_tokens=cfg.rollout.max_new_tokens, logprobs=0, seed=cfg.seed)
    llm.generate(requests, params, use_tqdm=False)  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        outputs = llm.generate(requests, params, use_tqdm=False)
        times.append(time.perf_counter() - started)
    del llm
    return statistics.median(times), outputs


def bare_vllm_tokens_per_s(cfg: RLJobConfig, prompts, repeats: int) -> float:
    seconds, outputs = bare_vllm_generate(cfg, prompts, repeats)
    return sum(len(c.token_ids) for o in outputs for c in o.outputs) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="runs/arith/sft/hf_model")
    parser.add_argument("--data", default="runs/arith/data/rl_train.parquet")
    parser.add_argument("--out", default="runs/bench/rlvr")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--kl-coef", type=float, default=0.0)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    cfg = bench_config(args)

    rows, prompts = rlsys_steps(cfg)
    measured = rows[1:] or rows
    mean = {k: statistics.mean(r[k] for r in measured) for k, v in measured[0].items() if isinstance(v, (int, float))}
    bare = bare_vllm_tokens_per_s(cfg, prompts, repeats=3)

    print(f"\nRLVR benchmark: {args.prompts} prompts x n={args.n}, <= {args.max_new_tokens} new tokens, "
          f"{args.dp} FSDP2 ranks, {len(measured)} measured steps (first step excluded)")
    print(f"{'phase':<14}{'mean s':>10}{'share':>9}")
    for phase in PHASES:
        key = f"time/{phase}_s"
        if key in mean:
            print(f"{phase:<14}{mean[key]:>10.3f}{mean[key] / mean['time/step_s']:>9.1%}")
    print(f"{'step':<14}{mean['time/step_s']:>10.3f}")
    rollout_rate = mean["throughput/generated_tokens_per_s"]
    print(f"\nrollout generated tokens/s (rlsys, Ray actor): {rollout_rate:,.0f}")
    print(f"bare vLLM generate tokens/s (same prompts):    {bare:,.0f}")
    print(f"ratio rlsys / bare vLLM:                       {rollout_rate / bare:.2f}")
    print(f"weight sync: {mean['sync/time_s']:.3f} s = {mean['sync/time_s'] / mean['time/step_s']:.1%} of the step "
          f"({mean['sync/mb']:.1f} MB in {mean['sync/buckets']:.0f} buckets)")


if __name__ == "__main__":
    main()
