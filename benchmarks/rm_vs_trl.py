"""rlsys's `rm` stage beside TRL's RewardTrainer on the same preference pairs, model and settings.

    .venv/bin/pip install -e '.[cpu,test,bench]'     # TRL is a benchmark extra only
    bash examples/arith/run.sh                        # the SFT model and the pairs
    .venv/bin/python benchmarks/rm_vs_trl.py --steps 200 --lr 1e-3

Both trainers start from the same model (the arithmetic example's SFT model, a one-output head in
place of the LM head), read the same training pairs (`preferences.jsonl`: each training problem's
answer chosen over a near miss) through the model's chat template, and run the same number of
steps of the same global batch with AdamW, the same peak learning rate, warm-up, cosine decay and
gradient clipping. Bradley-Terry's loss is the same in both. Both final models are then scored by
one scorer (a transformers forward of the exported sequence classifier, the value at the last
token) on held-out pairs built the same way from the test problems (`preferences_test.jsonl`):
pair accuracy is the share of pairs whose chosen response scores higher.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rlsys_rm(args, out: str) -> float:
    """The `rm` stage, as a user runs it; returns its wall time."""
    started = time.time()
    subprocess.run([sys.executable, "-m", "rlsys.run", "rm", "--config", "examples/arith/sft.yaml",
                    f"output_dir={out}", f"model.path={args.model}", f"data.train_files=[{args.pairs}]",
                    f"train.steps={args.steps}", f"train.global_batch_size={args.batch}",
                    f"train.micro_batch_size={args.batch // 2}", f"optim.lr={args.lr}",
                    f"optim.warmup_steps={args.warmup}", "train.save_every=0", "eval=null",
                    f"data.val_files=[{args.test_pairs}]", f"train.val_every={max(1, args.steps // 4)}",
                    "tracking.backends=[jsonl]"], check=True, cwd=REPO)
    return time.time() - started


def trl_rm(args, out: str) -> float:
    """TRL's RewardTrainer, one process, the same settings; returns its wall time."""
    import datasets
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    started = time.time()
    rows = [json.loads(line) for line in open(args.pairs)]
    data = datasets.Dataset.from_list([{"prompt": r["prompt"],
                                        "chosen": [{"role": "assistant", "content": r["chosen"]}],
                                        "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in rows])
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=1, dtype=torch.float32)
    config = RewardConfig(output_dir=out, max_steps=args.steps, per_device_train_batch_size=args.batch,
                          learning_rate=args.lr, lr_scheduler_type="cosine_with_min_lr",
                          lr_scheduler_kwargs={"min_lr_rate": 0.1}, warmup_steps=args.warmup,
                          adam_beta1=0.9, adam_beta2=0.95, weight_decay=0.0, max_grad_norm=1.0,
                          bf16=False, fp16=False, gradient_checkpointing=False, use_cpu=True, seed=0,
                          logging_steps=max(1, args.steps // 10), save_strategy="no", report_to=[],
                          dataloader_num_workers=0)
    trainer = RewardTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer)
    trainer.train()
    trainer.save_model(os.path.join(out, "hf_model"))
    return time.time() - started


@torch.no_grad()
def pair_accuracy(model_dir: str, pairs_file: str) -> tuple[float, float]:
    """(accuracy, mean margin) of a sequence classifier on `pairs_file`, the value at each text's last token."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()

    def score(prompt: list[dict], response: str) -> float:
        text = tokenizer.apply_chat_template([*prompt, {"role": "assistant", "content": response}], tokenize=False)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        return float(model(input_ids=ids).logits.reshape(-1)[0])  # one text, unpadded: its last token

    margins = [score(r["prompt"], r["chosen"]) - score(r["prompt"], r["rejected"])
               for r in map(json.loads, open(pairs_file))]
    return sum(m > 0 for m in margins) / len(margins), sum(margins) / len(margins)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="runs/arith/sft/hf_model")
    parser.add_argument("--pairs", default="runs/arith/data/preferences.jsonl")
    parser.add_argument("--test-pairs", default="runs/arith/data/preferences_test.jsonl")
    parser.add_argument("--out", default="runs/bench/rm_vs_trl")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64, help="pairs a step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--only", choices=("rlsys", "trl"), default=None)
    args = parser.parse_args()

    results = {}
    for name, train in (("rlsys", rlsys_rm), ("TRL", trl_rm)):
        if args.only and args.only != name.lower():
            continue
        out = os.path.join(args.out, name.lower())
        seconds = train(args, out)
        accuracy, margin = pair_accuracy(os.path.join(out, "hf_model"), args.test_pairs)
        results[name] = (accuracy, margin, seconds)
    print(f"\n{args.steps} steps x {args.batch} pairs, lr {args.lr:g}, warm-up {args.warmup}, from {args.model}")
    print("| trainer | held-out pair accuracy | mean margin | wall time |")
    print("|---|---|---|---|")
    for name, (accuracy, margin, seconds) in results.items():
        print(f"| {name} | {accuracy:.1%} | {margin:.3f} | {seconds:.0f} s |")
    if not math.isfinite(sum(r[1] for r in results.values())):
        sys.exit("a margin is not finite")


if __name__ == "__main__":
    main()
