"""On-policy distillation on the arithmetic task, against GRPO at equal training time. The student
is the example's SFT stage on the right answers (`sft_train.jsonl`) cut short (300 of its 1,500 steps:
a model with errors left, as examples/arith/reward_model.py trains), the teacher the main job's final
model. From the student's
checkpoint three runs train: GRPO on the verifier alone, and GRPO plus distillation from the
teacher, with the sampled token's reverse KL as advantage (`algorithm.distill`) and with the KL
over the teacher's top-k tokens as a loss term (`algorithm.distill.top_k`). Every run validates on
the held-out split as it goes; the table reads each run's accuracy at the same training time (the
sum of its steps' times), and GRPO gets twice the steps so that it is still running then.

    .venv/bin/python examples/arith/distill.py

Run after the main job (`bash examples/arith/run.sh`), which writes the data and the teacher.
Every stage runs as `python -m rlsys.run <stage>` with the example's configs and overrides, and is
skipped when its directory holds a finished run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


RIGHT_ANSWERS = ("data.train_files=[runs/arith/data/sft_train.jsonl]",)
"""A student's SFT data: every answer right, not the main job's careless teacher's."""


def stage(kind: str, config: str, *overrides: str) -> float:
    """Run one stage (skipped when its summary exists); its wall time in seconds."""
    out = next(o.split("=", 1)[1] for o in overrides if o.startswith("output_dir="))
    if os.path.isfile(os.path.join(out, "summary.json")):
        return json.load(open(os.path.join(out, "summary.json"))).get("time_s", 0.0)
    started = time.time()
    subprocess.run([sys.executable, "-m", "rlsys.run", kind, "--config", config, *overrides], check=True)
    return time.time() - started


def summary(out: str) -> dict:
    return json.load(open(os.path.join(out, "summary.json")))


def held_out(stage_summary: dict) -> float:
    """A finished stage's final held-out accuracy: an SFT stage's eval, an RL stage's last validation."""
    return stage_summary["eval"]["accuracy"] if "eval" in stage_summary else stage_summary["val_accuracy_after"]


def rows(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def curve(out: str) -> list[tuple[float, float]]:
    """(training seconds so far, held-out accuracy) at each validation: step 0's, then every
    train.val_every steps."""
    points, elapsed = [], 0.0
    for row in rows(out):
        elapsed += row.get("time/step_s", 0.0)
        if "val/accuracy" in row:
            points.append((elapsed, row["val/accuracy"]))
    return points


def at_time(points: list[tuple[float, float]], seconds: float) -> float:
    """The accuracy of the last validation within `seconds` of training."""
    return [accuracy for elapsed, accuracy in points if elapsed <= seconds + 1e-9][-1]


def first_and_last(out: str, name: str) -> str:
    values = [row[name] for row in rows(out) if name in row]
    return f"{values[0]:.2f} -> {values[-1]:.2f}" if values else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher", default="runs/arith/rlvr/hf_model")
    parser.add_argument("--out", default="runs/arith/distill")
    parser.add_argument("--student-steps", type=int, default=300, help="the student's SFT steps (the example's: 1500)")
    parser.add_argument("--rl-steps", type=int, default=100, help="the distillation runs' steps (GRPO: twice)")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--coef", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=1e-4, help="every RL run's peak learning rate")
    args = parser.parse_args()

    sft = os.path.join(args.out, "student")
    stage("sft", "examples/arith/sft.yaml", f"output_dir={sft}", f"train.steps={args.student_steps}", *RIGHT_ANSWERS)
    val_every = max(1, args.rl_steps // 10)
    rl = [f"model.path={sft}/hf_model", f"optim.lr={args.lr}", "train.save_every=0", f"train.val_every={val_every}",
          "tracking.backends=[jsonl]"]
    teacher = [f"algorithm.distill.teacher={args.teacher}", f"algorithm.distill.coef={args.coef}",
               "algorithm.distill.source=trainer"]  # a forward in the training group: the cheapest here
    runs = {
        "GRPO (verifier)": [f"output_dir={args.out}/grpo", f"train.steps={2 * args.rl_steps}", *rl],
        "GRPO + distillation, sampled token": [f"output_dir={args.out}/sampled", f"train.steps={args.rl_steps}",
                                               *rl, *teacher],
        f"GRPO + distillation, top-{args.top_k}": [f"output_dir={args.out}/top{args.top_k}",
                                                  f"train.steps={args.rl_steps}", *rl, *teacher,
                                                  f"algorithm.distill.top_k={args.top_k}"],
    }
    for overrides in runs.values():
        stage("rlvr", "examples/arith/rlvr.yaml", *overrides)
    outs = {name: overrides[0].split("=", 1)[1] for name, overrides in runs.items()}
    curves = {name: curve(out) for name, out in outs.items()}
    budget = min(points[-1][0] for points in curves.values())
    print(f"\nteacher {args.teacher}: {held_out(summary(args.teacher.rsplit('/', 1)[0])):.1%} held-out; "
          f"student: the example's SFT stage cut to {args.student_steps} steps "
          f"({summary(sft)['eval']['accuracy']:.1%}); RL at lr {args.lr:g}")
    print(f"| run | steps | held-out accuracy at {budget:.0f} s of training | at its end (training s) "
          "| reverse KL to the teacher, first -> last step |")
    print("|---|---|---|---|---|")
    for name, points in curves.items():
        steps = summary(outs[name])["steps"]
        print(f"| {name} | {steps} | {points[0][1]:.1%} -> {at_time(points, budget):.1%} | {points[-1][1]:.1%} "
              f"({points[-1][0]:.0f} s) | {first_and_last(outs[name], 'distill/reverse_kl')} |")


if __name__ == "__main__":
    main()
