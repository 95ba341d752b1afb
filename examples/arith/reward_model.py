"""A learned reward against the verifier on the arithmetic task: the `rm` stage trains a reward
model from the example's SFT model on preference pairs (each training problem's answer chosen
over a near miss, `preferences.jsonl`), then the same student is trained by GRPO twice at equal
steps, rewarded by the verifier and by the reward model (a served model term); held-out accuracy
is the verifier's in both.

    .venv/bin/python examples/arith/reward_model.py --student runs/arith/distill/sft/hf_model

Run after the main job and `examples/arith/distill.py` (which writes the 2-layer student). Every
stage runs as `python -m rlsys.run <stage>` with the example's configs and overrides.
"""

from __future__ import annotations

import argparse
import json
import os

from distill import stage, summary


def pair_accuracy(out: str) -> str:
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return f"{rows[0]['rm/accuracy']:.1%} -> {rows[-1]['rm/accuracy']:.1%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="runs/arith/sft/hf_model", help="the reward model's starting model")
    parser.add_argument("--student", default="runs/arith/distill/sft/hf_model")
    parser.add_argument("--out", default="runs/arith/reward_model")
    parser.add_argument("--rm-steps", type=int, default=200)
    parser.add_argument("--rl-steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=5e-4)
    args = parser.parse_args()

    rm = os.path.join(args.out, "rm")
    rm_time = stage("rm", "examples/arith/sft.yaml", f"output_dir={rm}", f"model.path={args.base}",
                    "data.train_files=[runs/arith/data/preferences.jsonl]", f"train.steps={args.rm_steps}",
                    "train.global_batch_size=64", "train.micro_batch_size=32", "optim.lr=1e-3", "eval=null")
    rl = [f"model.path={args.student}", f"train.steps={args.rl_steps}", f"optim.lr={args.lr}", "train.save_every=0",
          f"train.val_every={args.rl_steps}", "tracking.backends=[jsonl]"]
    runs = {
        "verifier": [f"output_dir={args.out}/verifier", *rl],
        "reward model": [f"output_dir={args.out}/learned", *rl,
                         f"reward.terms=[{{name: rm, model: {rm}/hf_model, serving: {{engine_memory_gib: 0.25}}}}]"],
    }
    times = {name: stage("rlvr", "examples/arith/rlvr.yaml", *overrides) for name, overrides in runs.items()}
    print(f"\nreward model from {args.base}: {args.rm_steps} steps, pair accuracy {pair_accuracy(rm)}, {rm_time:.0f} s")
    print("| reward | steps | lr | held-out accuracy (the verifier's) before -> after | wall time |")
    print("|---|---|---|---|---|")
    for name, overrides in runs.items():
        result = summary(overrides[0].split("=", 1)[1])
        print(f"| {name} | {args.rl_steps} | {args.lr:g} | {result.get('val_accuracy_before', 0):.1%} -> "
              f"{result['val_accuracy_after']:.1%} | {times[name]:.0f} s |")


if __name__ == "__main__":
    main()
