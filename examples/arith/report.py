"""Plot an RLVR run's reward and held-out accuracy curves and write a short report.

    python examples/arith/report.py --run runs/arith/rlvr --out examples/arith
"""

from __future__ import annotations

import argparse
import json
import os

import matplotlib
import yaml

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


PHASES = ("time/generate_s", "time/reward_s", "time/old_logprob_s", "time/ref_logprob_s", "time/update_s",
          "time/sync_s")
"""A step's phases, as far as the run logged them (old log-probs only when the policy moved since sampling)."""


def read_metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def plot(rows: list[dict], path: str, temperature: float) -> None:
    train = [r for r in rows if "reward/mean" in r]
    val = [r for r in rows if "val/accuracy" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in train], [r["reward/mean"] for r in train], alpha=0.6,
            label=f"train reward (sampled, T={temperature:g})")
    ax.plot([r["step"] for r in val], [r["val/accuracy"] for r in val], marker="o",
            label="held-out accuracy (greedy)")
    ax.set_xlabel("RL step")
    ax.set_ylabel("fraction correct")
    ax.set_title("rlsys GRPO on arithmetic (tiny Qwen2, one rank + vLLM, CPU)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(rows: list[dict], summary: dict, image: str) -> str:
    val = [(r["step"], r["val/accuracy"]) for r in rows if "val/accuracy" in r]
    steps = [r for r in rows if "time/step_s" in r]
    mean = lambda key: sum(r[key] for r in steps) / len(steps)  # noqa: E731
    lines = [
        "# Arithmetic RLVR run", "",
        f"![reward and accuracy]({os.path.basename(image)})", "",
        f"- held-out greedy accuracy: {val[0][1]:.1%} (SFT start) -> {val[-1][1]:.1%} after {val[-1][0]} steps "
        f"({(val[-1][1] - val[0][1]) * 100:+.1f} points; best {max(v for _, v in val):.1%})",
        f"- wall time of the stage: {summary.get('time_s', float('nan')):.0f} s "
        "(start-up, validation and export included)",
        f"- mean step {mean('time/step_s'):.2f} s: "
        + ", ".join(f"{key[5:-2].replace('_', ' ')} {mean(key):.3f}" for key in PHASES if key in steps[0]),
        f"- trainer vs engine log-prob gap (mean |diff|): {mean('rollout/logprob_abs_diff'):.1e}",
        "", "| step | held-out accuracy |", "|---|---|",
        *[f"| {step} | {acc:.1%} |" for step, acc in val],
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", default="runs/arith/rlvr")
    parser.add_argument("--out", default="examples/arith")
    args = parser.parse_args()
    rows = read_metrics(args.run)
    summary_path = os.path.join(args.run, "summary.json")
    summary = json.load(open(summary_path)) if os.path.isfile(summary_path) else {}
    image = os.path.join(args.out, "rlvr_curve.png")
    with open(os.path.join(args.run, "config.yaml")) as f:
        temperature = yaml.safe_load(f)["rollout"]["temperature"]
    plot(rows, image, temperature)
    with open(os.path.join(args.out, "RLVR_REPORT.md"), "w") as f:
        f.write(report(rows, summary, image))
    print(f"wrote {image} and {os.path.join(args.out, 'RLVR_REPORT.md')}")


if __name__ == "__main__":
    main()
