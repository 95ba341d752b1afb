"""An RL job run for a benchmark: its config from dotted overrides, run to the end, its metrics
as logged (metrics.jsonl), one dict a step."""

from __future__ import annotations

import argparse
import json
import os
import statistics


def quick_job(model: str, data: str, steps: int, prompts: int) -> list[str]:
    """The side-by-side benchmarks' job: 8 short responses a prompt, one rank, no checkpoints or
    validation, the arithmetic verifier unless a run names other reward terms."""
    return [f"model.path={model}", f"data.train_files=[{data}]", "rollout.n=8", "rollout.max_new_tokens=8",
            "rollout.engine_memory_gib=0.25", f"train.steps={steps}", f"train.prompts_per_step={prompts}",
            "train.micro_batch_tokens=16384", "train.save_every=0", "train.val_every=0", "eval=null",
            "optim.lr=5e-5", "parallel.dp_shard=1", "seed=0", "reward.terms=[{name: arith}]"]


def run_job(out: str, overrides: list[str]) -> list[dict]:
    """Run the RL job in `out` (from scratch) and return its logged rows."""
    import rlsys.tasks  # noqa: F401  (registers the arith verifier, as `python -m rlsys.run` does)
    from rlsys.config.loader import load_config
    from rlsys.config.schema import RLJobConfig
    from rlsys.stages.rl_trainer import run_rlvr

    run_rlvr(load_config(RLJobConfig, None, [f"output_dir={out}", "train.resume=false", "ray.include_dashboard=false",
                                             "tracking.backends=[jsonl]", *overrides]))
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def mean_after_first(rows: list[dict], figures: tuple[str, ...]) -> dict[str, float]:
    """Each figure's mean over the steps after the first (step 0, validation, is not a step)."""
    steps = [row for row in rows if "time/step_s" in row][1:]
    return {f: statistics.mean(row.get(f, 0.0) for row in steps) for f in figures}


def quick_job_args(description: str, out: str) -> argparse.Namespace:
    """The side-by-side benchmarks' command line: the policy, the prompts, where runs go, their size."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", default=out)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=64)
    return parser.parse_args()


def side_by_side(args: argparse.Namespace, runs: dict[str, list[str]], figures: tuple[str, ...]
                 ) -> dict[str, dict[str, float]]:
    """Run each quick job (its name -> its own overrides) one after the other and print their
    figures as one table; each run's mean over the steps after the first."""
    results = {}
    for name, extra in runs.items():
        out = os.path.join(args.out, "".join(c if c.isalnum() else "_" for c in name))
        rows = run_job(out, quick_job(args.model, args.data, args.steps, args.prompts) + extra)
        results[name] = mean_after_first(rows, figures)
    print(f"\n{args.prompts} prompts x 8 responses a step, mean of steps 2..{args.steps}")
    print("| run | " + " | ".join(figures) + " |")
    print("|---|" + "---|" * len(figures))
    for name, values in results.items():
        print(f"| {name} | " + " | ".join(f"{values[f]:.3f}" for f in figures) + " |")
    return results
