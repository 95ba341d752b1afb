"""Fault injection on the arithmetic example: a worker killed (or stopped) in the middle of a run,
one kind per run, beside the same run uninterrupted.

    bash examples/arith/run.sh                          # the SFT model and the data
    .venv/bin/python benchmarks/worker_faults.py

Every run is `python -m rlsys.run rlvr --config examples/arith/rlvr.yaml` as a user runs it, 12
steps from the SFT model, distilling the SFT model as a teacher served by its own engine (so that
a teacher's engine is there to kill), validation every 4 steps, no checkpoint. Once step
`--at` is logged, the worker is sent SIGKILL (SIGSTOP for the hung engine, whose call then runs
past `rollout.timeout_s`). The table gives, per run: the steps lost (trained again after a
checkpoint restore), whether every step's metrics equal the uninterrupted run's, and the time
to recover (the faulted step's time less the same step's time uninterrupted).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPARED = ("reward/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm", "distill/reverse_kl",
            "val/accuracy")
CASES = [  # (worker kind, mode, actor log name, signal, extra overrides)
    ("rollout engine", "sync", "rollout-0", signal.SIGKILL, []),
    ("reward worker", "sync", "reward-0", signal.SIGKILL, []),
    ("teacher engine (served model)", "sync", "teacher-0", signal.SIGKILL, []),
    ("rollout engine, hung", "sync", "rollout-0", signal.SIGSTOP, ["rollout.timeout_s=20"]),
    ("rollout engine", "async (full)", "rollout-0", signal.SIGKILL, []),
]
ASYNC = ["train.async_mode=full", "train.max_staleness=1", "rollout.placement=separate", "ray.cpus_per_worker=1"]


def run(out: str, overrides: list[str], fault: tuple[str, int, int] | None) -> float:
    """One run; `fault`: (actor log name, signal, step after which it is sent). Its wall time."""
    started = time.time()
    process = subprocess.Popen([sys.executable, "-m", "rlsys.run", "rlvr", "--config", "examples/arith/rlvr.yaml",
                                f"output_dir={out}", *overrides], cwd=REPO)
    if fault is not None:
        threading.Thread(target=inject, args=(out, *fault), daemon=True).start()
    if process.wait() != 0:
        raise SystemExit(f"{out}: the run ended with exit code {process.returncode}")
    return time.time() - started


def inject(out: str, worker: str, sig: int, step: int) -> None:
    while steps_logged(out) < step:
        time.sleep(0.05)
    wanted = os.path.join(out, "logs", f"{worker}.log")
    for process in psutil.process_iter():
        try:
            if process.environ().get("RLSYS_LOG_FILE") == wanted:
                process.send_signal(sig)
                return
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue


def steps_logged(out: str) -> int:
    path = os.path.join(out, "metrics.jsonl")
    return sum(1 for line in open(path) if '"step": 0,' not in line) if os.path.isfile(path) else 0


def rows(out: str) -> dict[int, dict]:
    return {row["step"]: row for row in map(json.loads, open(os.path.join(out, "metrics.jsonl")))}


def equal(got: dict[int, dict], expected: dict[int, dict]) -> bool:
    return got.keys() == expected.keys() and all(
        abs(got[s].get(name, 0.0) - expected[s].get(name, 0.0)) <= 1e-5 for s in got for name in COMPARED)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench/worker_faults")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--at", type=int, default=5, help="the fault comes once this many steps are logged")
    parser.add_argument("--teacher", default="runs/arith/sft/hf_model")
    args = parser.parse_args()
    base = [f"train.steps={args.steps}", "train.save_every=0", "train.val_every=4", "tracking.backends=[jsonl]",
            f"algorithm.distill.teacher={args.teacher}", "algorithm.distill.coef=0.1",
            "algorithm.distill.serving.engine_memory_gib=0.25"]
    print("| worker killed | mode | steps lost | metrics equal the uninterrupted run's | time to recover | "
          "workers replaced |")
    print("|---|---|---|---|---|---|")
    references: dict[str, dict[int, dict]] = {}
    for index, (kind, mode, worker, sig, extra) in enumerate(CASES):
        overrides = base + (ASYNC if mode != "sync" else []) + extra
        if mode not in references:
            reference = os.path.join(args.out, f"uninterrupted-{mode.split()[0]}")
            run(reference, overrides, None)
            references[mode] = rows(reference)
        out = os.path.join(args.out, f"case{index}")
        run(out, overrides, (f"{worker}", sig, args.at))
        got, summary = rows(out), json.load(open(os.path.join(out, "summary.json")))
        faulted = args.at + 1
        recover = got[faulted]["time/step_s"] - references[mode][faulted]["time/step_s"]
        lost = 0 if summary["restarts"] == 0 else "checkpoint restore"
        same = "yes" if equal(got, references[mode]) else "no (regenerated: " \
            f"{got[args.steps].get('async/regenerated_groups', 0):.0f} groups)"
        print(f"| {kind} | {mode} | {lost} | {same} | {recover:.1f} s | {summary['workers_replaced']:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
