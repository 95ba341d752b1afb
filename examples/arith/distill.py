"""On-policy distillation on the arithmetic task: a smaller student (2 of the teacher's 4 layers'
shape, hidden 128) is pretrained and fine-tuned briefly, then trained from the same checkpoint by
GRPO on the verifier alone and by GRPO plus distillation from the teacher (the example's SFT or RL
model), at equal steps; the table holds held-out accuracy and wall time of each.

    .venv/bin/python examples/arith/distill.py --teacher runs/arith/rlvr/hf_model

Run after the main job (`bash examples/arith/run.sh`), which writes the data and the teacher.
Every stage runs as `python -m rlsys.run <stage>` with the example's configs and overrides.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

STUDENT_LAYERS = 2


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


def reverse_kl(out: str) -> str:
    """distill/reverse_kl of the first and last steps (logged only with a teacher)."""
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    values = [row["distill/reverse_kl"] for row in rows if "distill/reverse_kl" in row]
    return f"{values[0]:.2f} -> {values[-1]:.2f}" if values else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher", default="runs/arith/sft/hf_model")
    parser.add_argument("--out", default="runs/arith/distill")
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("--sft-steps", type=int, default=150)
    parser.add_argument("--rl-steps", type=int, default=100)
    parser.add_argument("--coef", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=5e-4,
                        help="both RL runs' peak learning rate (the example's GRPO from a strong SFT model takes 5e-5)")
    args = parser.parse_args()

    init = os.path.join(args.out, "student-init")
    if not os.path.isfile(os.path.join(init, "config.json")):
        subprocess.run([sys.executable, "-m", "rlsys.models.tiny", "--out", init,
                        f"--num-hidden-layers={STUDENT_LAYERS}"], check=True)
    pretrain, sft = os.path.join(args.out, "pretrain"), os.path.join(args.out, "sft")
    stage("pretrain", "examples/arith/pretrain.yaml", f"output_dir={pretrain}", f"model.path={init}",
          f"train.steps={args.pretrain_steps}", "eval=null")
    stage("sft", "examples/arith/sft.yaml", f"output_dir={sft}", f"model.path={pretrain}/hf_model",
          f"train.steps={args.sft_steps}")
    rl = [f"model.path={sft}/hf_model", f"train.steps={args.rl_steps}", f"optim.lr={args.lr}", "train.save_every=0",
          f"train.val_every={args.rl_steps}", "tracking.backends=[jsonl]"]
    runs = {
        "GRPO (verifier)": [f"output_dir={args.out}/grpo-lr{args.lr:g}", *rl],
        "GRPO + distillation": [f"output_dir={args.out}/distill-lr{args.lr:g}", *rl,
                                f"algorithm.distill.teacher={args.teacher}", f"algorithm.distill.coef={args.coef}",
                                "algorithm.distill.serving.engine_memory_gib=0.25"],
    }
    times = {name: stage("rlvr", "examples/arith/rlvr.yaml", *overrides) for name, overrides in runs.items()}
    before = summary(sft).get("eval", {}).get("accuracy")
    print(f"\nstudent ({STUDENT_LAYERS} layers) after SFT: {before}; teacher {args.teacher}")
    print("| run | steps | lr | held-out accuracy before -> after | reverse KL to the teacher, first -> last step "
          "| wall time |")
    print("|---|---|---|---|---|---|")
    for name, overrides in runs.items():
        out = overrides[0].split("=", 1)[1]
        result, kl = summary(out), reverse_kl(out)
        print(f"| {name} | {args.rl_steps} | {args.lr:g} | {result.get('val_accuracy_before', 0):.1%} -> "
              f"{result['val_accuracy_after']:.1%} | {kl} | {times[name]:.0f} s |")


if __name__ == "__main__":
    main()
