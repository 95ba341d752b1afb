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

import os

from rl_runs import quick_job_args, side_by_side

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


def main() -> None:
    args = quick_job_args(__doc__, "runs/bench/model_terms")
    rm = write_reward_model(args.model, os.path.join(args.out, "reward-model"))
    rm_term = f"{{name: rm, model: {rm}, weight: 0.1, serving: {{engine_memory_gib: 0.25}}}}"
    runs = {
        "verifier": [],
        "verifier + reward model": [f"reward.terms=[{{name: arith}}, {rm_term}]"],
        "verifier + teacher (engine)": [f"algorithm.distill.teacher={args.model}",
                                        "algorithm.distill.serving.engine_memory_gib=0.25"],
        "verifier + teacher (trainer)": [f"algorithm.distill.teacher={args.model}", "algorithm.distill.source=trainer"],
    }
    side_by_side(args, runs, FIGURES)


if __name__ == "__main__":
    main()
