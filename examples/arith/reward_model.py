"""A learned reward against the verifier on the arithmetic task. The `rm` stage trains a reward model
from the example's SFT model on preference pairs (each training problem's answer chosen over a near
miss, `preferences.jsonl`) and scores held-out pairs of the test problems (`preferences_test.jsonl`,
`data.val_files`) as it goes. Then a student with errors left (the example's SFT stage cut short)
is trained by GRPO twice at equal steps, rewarded by the verifier and by the reward model (a served
model term); held-out accuracy is the verifier's in both.

    .venv/bin/python examples/arith/reward_model.py

Run after the main job (`bash examples/arith/run.sh`), which writes the data and the SFT model.
Every stage runs as `python -m rlsys.run <stage>` with the example's configs and overrides, and is
skipped when its directory holds a finished run.
"""

from __future__ import annotations

import argparse
import os

from distill import RIGHT_ANSWERS, stage, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="runs/arith/sft/hf_model", help="the reward model's starting model")
    parser.add_argument("--out", default="runs/arith/reward_model")
    parser.add_argument("--rm-steps", type=int, default=3000)
    parser.add_argument("--rm-lr", type=float, default=3e-4)
    parser.add_argument("--student-steps", type=int, default=300, help="the student's SFT steps (the example's: 1500)")
    parser.add_argument("--rl-steps", type=int, default=150)
    args = parser.parse_args()

    rm = os.path.join(args.out, "rm")
    rm_time = stage("rm", "examples/arith/sft.yaml", f"output_dir={rm}", f"model.path={args.base}",
                    "data.train_files=[runs/arith/data/preferences.jsonl]",
                    "data.val_files=[runs/arith/data/preferences_test.jsonl]", f"train.steps={args.rm_steps}",
                    f"train.val_every={max(1, args.rm_steps // 4)}", "train.global_batch_size=64",
                    "train.micro_batch_size=32", f"optim.lr={args.rm_lr}", "train.save_every=0", "eval=null")
    student = os.path.join(args.out, "student")
    stage("sft", "examples/arith/sft.yaml", f"output_dir={student}", f"train.steps={args.student_steps}",
          *RIGHT_ANSWERS)
    rl = [f"model.path={student}/hf_model", f"train.steps={args.rl_steps}", "train.save_every=0",
          f"train.val_every={args.rl_steps}", "tracking.backends=[jsonl]"]
    runs = {
        "the verifier": [f"output_dir={args.out}/verifier", *rl],
        "the learned reward model": [f"output_dir={args.out}/learned", *rl,
                                     f"reward.terms=[{{name: rm, model: {rm}/hf_model, "
                                     "serving: {engine_memory_gib: 0.25}}]"],
    }
    times = {name: stage("rlvr", "examples/arith/rlvr.yaml", *overrides) for name, overrides in runs.items()}
    pairs = summary(rm)
    print(f"\nreward model from {args.base}: {args.rm_steps} steps (lr {args.rm_lr:g}), held-out pair accuracy "
          f"{pairs['val_rm_accuracy_after']:.1%} (its zero head ties every pair at first), {rm_time:.0f} s")
    print(f"student: the example's SFT stage, {args.student_steps} steps; GRPO {args.rl_steps} steps on each reward")
    print("| reward | held-out accuracy (the verifier's) before -> after | wall time |")
    print("|---|---|---|")
    for name, overrides in runs.items():
        result = summary(overrides[0].split("=", 1)[1])
        print(f"| {name} | {result.get('val_accuracy_before', 0):.1%} -> {result['val_accuracy_after']:.1%} "
              f"| {times[name]:.0f} s |")


if __name__ == "__main__":
    main()
