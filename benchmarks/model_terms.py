"""What a model in the loop costs per RL step, side by side in one run: the same job scored by the
verifier alone (a function term), by the verifier and a reward model (a model term served by a
vLLM engine), and by the verifier with a distillation teacher, served by a vLLM engine or held by
the training group. Each run's mean over its steps after the first of each phase's seconds.

    .venv/bin/python benchmarks/model_terms.py --model runs/arith/sft/hf_model \\
        --data runs/arith/data/rl_train.parquet

The reward model is the policy's shape with a random one-logit head (`TinyModelSpec`'s
reward_head), the teacher the policy itself: what is timed is serving them, not what they score.
"""

from __future__ import annotations

import argparse
import os

from rl_runs import mean_after_first, quick_job, run_job

FIGURES = ("time/generate_s", "time/reward_s", "time/teacher_s", "time/update_s", "time/step_s")


def write_reward_model(policy: str, out: str) -> str:
    """A one-logit sequence-classification model of the policy's shape and tokenizer."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    if not os.path.isfile(os.path.join(out, "config.json")):
        config = AutoConfig.from_pretrained(policy)
        config.num_labels = 1
        AutoModelForSequenceClassification.from_config(config).save_pretrained(out)
        AutoTokenizer.from_pretrained(policy).save_pretrained(out)
    return out


def run(args, name: str, extra: list[str]) -> dict[str, float]:
    rows = run_job(os.path.join(args.out, name), quick_job(args.model, args.data, args.steps, args.prompts) + extra)
    return mean_after_first(rows, FIGURES)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", default="runs/bench/model_terms")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=64)
    args = parser.parse_args()
    rm = write_reward_model(args.model, os.path.join(args.out, "reward-model"))
    rm_term = f"{{name: rm, model: {rm}, weight: 0.1, serving: {{engine_memory_gib: 0.25}}}}"
    runs = {
        "verifier": ["reward.terms=[{name: arith}]"],
        "verifier + reward model": [f"reward.terms=[{{name: arith}}, {rm_term}]"],
        "verifier + teacher (engine)": ["reward.terms=[{name: arith}]", f"algorithm.distill.teacher={args.model}",
                                        "algorithm.distill.serving.engine_memory_gib=0.25"],
        "verifier + teacher (trainer)": ["reward.terms=[{name: arith}]", f"algorithm.distill.teacher={args.model}",
                                         "algorithm.distill.source=trainer"],
    }
    results = {name: run(args, "".join(c if c.isalnum() else "_" for c in name), extra)
               for name, extra in runs.items()}
    print(f"\n{args.prompts} prompts x 8 responses a step, mean of steps 2..{args.steps}")
    print("| run | " + " | ".join(FIGURES) + " |")
    print("|---|" + "---|" * len(FIGURES))
    for name, figures in results.items():
        print(f"| {name} | " + " | ".join(f"{figures[f]:.3f}" for f in FIGURES) + " |")


if __name__ == "__main__":
    main()
