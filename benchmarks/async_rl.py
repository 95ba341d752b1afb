"""Asynchronous RL side by side: samples per second and held-out accuracy of the same number
of samples, for synchronous steps (colocated, the default layout, and separate) and the two
asynchronous modes (separate placement: the training rank and the engine a core each), with
what repeating them exactly costs: one_step with syncs that wait for the groups in flight, full
without recording its schedule, and full following the schedule recorded by the full run before it.

    .venv/bin/python benchmarks/async_rl.py --model runs/arith/sft/hf_model \\
        --data runs/arith/data/rl_train.parquet --test runs/arith/data/test.parquet --steps 40

Each layout runs `--steps` RL steps of the same prompts (the arithmetic stage's settings:
`--prompts` x `--n`, <= `--max-new-tokens` new tokens), one after the other in this process,
then validates on `--test`. Samples per second are the trajectories trained in steps 2..N over
their wall time. It also prints, from the synchronous separate run's phase times, the step an
overlap could reach where generation and training each have a device of their own.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import ray

import rlsys.tasks  # noqa: F401  (registers the `arith` reward)
from rlsys.config.loader import load_config
from rlsys.config.schema import RLJobConfig
from rlsys.rl.run_schedule import SCHEDULE_FILE

LAYOUTS = {
    "off, colocated": ["rollout.placement=colocated"],
    "off, separate": ["rollout.placement=separate"],
    "one_step, separate": ["rollout.placement=separate", "train.async_mode=one_step"],
    "one_step, whole syncs": ["rollout.placement=separate", "train.async_mode=one_step", "train.partial_rollout=false"],
    "full, separate": ["rollout.placement=separate", "train.async_mode=full"],
    "full, unrecorded": ["rollout.placement=separate", "train.async_mode=full", "train.record_schedule=false"],
    "full, replayed": ["rollout.placement=separate", "train.async_mode=full", "train.replay={out}/full-separate"],
}
"""Asynchronous layouts record their schedule (schedule.jsonl) unless `unrecorded`; `whole syncs` wait for the
groups in flight (a one_step run that repeats exactly without a schedule); `replayed` follows the schedule
`full, separate` recorded earlier in the same benchmark run."""


def config(args, name: str) -> RLJobConfig:
    layout = [override.format(out=args.out) for override in LAYOUTS[name]]
    separate = "rollout.placement=separate" in layout
    return load_config(RLJobConfig, None, [
        f"output_dir={args.out}/{name.replace(', ', '-').replace(' ', '-')}", f"model.path={args.model}",
        f"data.train_files=[{args.data}]", f"rollout.n={args.n}", f"rollout.max_new_tokens={args.max_new_tokens}",
        "rollout.engine_memory_gib=0.25",
        f"train.steps={args.steps}", f"train.prompts_per_step={args.prompts}", "train.micro_batch_tokens=16384",
        "train.save_every=0", "train.resume=false", "train.val_every=0", "optim.lr=5e-5", "optim.warmup_steps=5",
        "optim.betas=[0.9,0.99]", "ray.include_dashboard=false", "tracking.backends=[jsonl]",
        f"ray.cpus_per_worker={1 if separate else 2}", "rollout.cpus_per_engine=1", "reward.terms=[{name: arith}]",
        *([f"eval.files=[{args.test}]", "eval.reward=arith", "eval.max_new_tokens=8"] if args.test else ["eval=null"]),
        *layout,
        *args.overrides])


def run(cfg: RLJobConfig) -> dict:
    from rlsys.actors.cluster import ensure_ray
    from rlsys.stages.rl_trainer import RLVRTrainer

    ensure_ray(cfg.ray)
    os.makedirs(cfg.output_dir, exist_ok=True)
    trainer = RLVRTrainer(cfg)
    try:
        trainer.resume()
        rows, ends = [], []
        for step in range(1, cfg.train.steps + 1):
            rows.append(trainer.step(step))
            trainer.end_step(step)
            ends.append(time.perf_counter())
        accuracy = trainer.validate(cfg.train.steps)["val/accuracy"] if cfg.eval else float("nan")
    finally:
        trainer.shutdown()
    samples = (cfg.train.steps - 1) * cfg.train.prompts_per_step * cfg.rollout.n
    phases = {p: statistics.median(r.get(f"time/{p}_s", 0.0) for r in rows[1:])
              for p in ("generate", "reward", "old_logprob", "update", "sync", "step")}
    schedule = os.path.join(cfg.output_dir, SCHEDULE_FILE)
    return {"samples_per_s": samples / (ends[-1] - ends[0]), "accuracy": accuracy, "phases": phases,
            "staleness": statistics.mean(r.get("async/staleness_mean", 0.0) for r in rows[1:]),
            "schedule_bytes_per_step": os.path.getsize(schedule) / cfg.train.steps if os.path.exists(schedule) else 0,
            "rewards": [r["reward/mean"] for r in rows]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="runs/arith/sft/hf_model")
    parser.add_argument("--data", default="runs/arith/data/rl_train.parquet")
    parser.add_argument("--test", default="runs/arith/data/test.parquet", help="'' for none")
    parser.add_argument("--out", default="runs/bench/async")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("overrides", nargs="*", help="rlsys config overrides (key=value)")
    args = parser.parse_args()

    results = {}
    for name in args.layouts:
        results[name] = run(config(args, name))
        ray.shutdown()
        print(f"{name}: {results[name]}", flush=True)
    base = results.get("off, separate")
    print(f"\n{args.prompts} prompts x {args.n}, <= {args.max_new_tokens} new tokens, {args.steps} steps each")
    print(f"{'layout':<24}{'samples/s':>11}{'vs off, separate':>18}{'held-out':>10}{'staleness':>11}"
          f"{'schedule B/step':>17}")
    for name, result in results.items():
        ratio = f"{result['samples_per_s'] / base['samples_per_s']:.2f}" if base else "-"
        print(f"{name:<24}{result['samples_per_s']:>11.1f}{ratio:>18}{result['accuracy']:>10.1%}"
              f"{result['staleness']:>11.2f}{result['schedule_bytes_per_step']:>17.0f}")
    if "full, separate" in results and "full, replayed" in results:
        same = results["full, separate"]["rewards"] == results["full, replayed"]["rewards"]
        print(f"\nfull, replayed: every step's reward {'equals' if same else 'DIFFERS from'} full, separate's")
    if base:
        p = base["phases"]
        serial = p["generate"] + p["reward"] + p["old_logprob"] + p["update"] + p["sync"]
        overlapped = max(p["generate"], p["reward"] + p["old_logprob"] + p["update"]) + p["sync"]
        print(f"\noff, separate, median phases: generate {p['generate']:.3f} s, update {p['update']:.3f} s, "
              f"old log-prob {p['old_logprob']:.3f} s, sync {p['sync']:.3f} s: with a device each, an overlap of "
              f"generation with training would take a step from {serial:.3f} to {overlapped:.3f} s "
              f"({serial / overlapped:.2f}x)")


if __name__ == "__main__":
    main()
