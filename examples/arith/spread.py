"""The main job at several seeds and thread counts: every stage's held-out accuracy, and RL's gain.

    .venv/bin/python examples/arith/spread.py --seeds 0 1 2 --threads 1 2

A machine's math libraries sum in an order set by its thread count, so the same seeds end training
apart on different machines; this runs the whole job (examples/arith/pipeline.yaml) under each
(seed, threads) to see how far apart. Run (S, T) lives in runs/arith-spread/seed<S>-threads<T>:
its tiny model initialised from seed S, every stage seeded S, the main job's data. T is the torch
thread count of every training rank: with T=1 pretraining and SFT run on two ranks of one thread
(the main job's layout on two cores), with T=2 on one rank of two threads (the same batches, reduced
in another order); the RL rank and its engine take T threads. Pretraining's own eval asks in the
chat format it has not learned yet, so the table gives the pretrained model's accuracy on the test
problems as raw text (`12+7=`) instead. A finished run is skipped, so the
command resumes where it stopped; `--report` tables the finished runs alone. The tables (every stage's
held-out accuracy and time; the sign of negative answers after SFT and after RL) go to
runs/arith-spread/spread.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import yaml

EXAMPLE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, EXAMPLE)
from prepare import prepare  # noqa: E402

from rlsys.models.tiny import TinyModelSpec  # noqa: E402

STAGES = ("pretrain", "sft", "rlvr")
CORES = 2
"""The main job's machine: pretraining and SFT take T-thread ranks, as many as fill it."""


def run_config(out: str, data: str, seed: int, threads: int) -> dict:
    """examples/arith/pipeline.yaml with run (seed, threads)'s model, seeds and layout."""
    with open(os.path.join(EXAMPLE, "pipeline.yaml")) as f:
        pipeline = yaml.safe_load(f)
    ranks = f"parallel.dp_shard={CORES // threads}"
    layout = {"pretrain": [ranks], "sft": [ranks], "rlvr": [f"ray.cpus_per_worker={threads}"], "eval": []}
    for spec in pipeline["stages"]:
        config = spec["config"]
        spec["overrides"] = [
            *([f"seed={seed}"] if spec["stage"] != "eval" else []),
            *layout[spec["stage"]],
            *_data_overrides(config, data),
        ]
    pipeline["output_dir"] = out
    pipeline["stages"][0]["overrides"].append(f"model.path={out}/tiny-init")
    return pipeline


def _data_overrides(config: str, data: str) -> list[str]:
    """The stage's data files and test split, read from `data` in place of runs/arith/data."""
    with open(config) as f:
        stage = yaml.safe_load(f)
    moved = []
    for key in ("data.train_files", "eval.files"):
        section, name = key.split(".")
        files = (stage.get(section) or {}).get(name)
        if files:
            moved.append(f"{key}=[{','.join(os.path.join(data, os.path.basename(p)) for p in files)}]")
    return moved


def run(out: str, data: str, seed: int, threads: int) -> None:
    """Run (seed, threads) of the whole job, unless it finished."""
    if finished(out) is not None:
        return
    prepare(out, TinyModelSpec(seed=seed), data_dir=data)
    config = os.path.join(out, "pipeline.yaml")
    with open(config, "w") as f:
        yaml.safe_dump(run_config(out, data, seed, threads), f, sort_keys=False)
    subprocess.run([sys.executable, "-m", "rlsys.run", "pipeline", "--config", config], check=True)


def finished(out: str) -> dict | None:
    """The pipeline summary of a finished run, else None."""
    summary = os.path.join(out, "summary.json")
    if not os.path.isfile(summary):
        return None
    with open(summary) as f:
        return json.load(f)


def raw_text_accuracy(model_dir: str, test_file: str) -> float:
    """Held-out accuracy of a pretrained model on the problems as pretraining wrote them (`12+7=`, no chat
    turn: what the stage's own chat-format eval cannot see), greedy, up to the end of the line."""
    import pandas as pd
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    rows = pd.read_parquet(test_file)
    right = 0
    for prompt, reward_model in zip(rows["prompt"], rows["reward_model"]):
        ids = tokenizer("\n" + prompt[0]["content"], return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        right += tokenizer.decode(out[0, ids.shape[1]:]).split("\n")[0].strip() == reward_model["ground_truth"]
    return right / len(rows)


def pretrained_accuracy(out: str, data: str) -> float:
    """Run `out`'s `raw_text_accuracy`, measured once and kept beside its pretrained model."""
    kept = os.path.join(out, "pretrain", "raw_text_accuracy.json")
    if not os.path.isfile(kept):
        accuracy = raw_text_accuracy(os.path.join(out, "pretrain", "hf_model"), os.path.join(data, "test.parquet"))
        with open(kept, "w") as f:
            json.dump({"accuracy": accuracy}, f)
    with open(kept) as f:
        return json.load(f)["accuracy"]


def row(seed: int, threads: int, out: str, data: str, summary: dict) -> dict:
    stages = {s["name"]: s for s in summary["stages"]}
    rl = stages["rlvr"]
    return {"seed": seed, "threads": threads, "raw": pretrained_accuracy(out, data),
            **{name: stages[name]["accuracy_after"] for name in STAGES},
            "gain": rl["accuracy_after"] - rl["accuracy_before"],
            **{f"{name}_s": stages[name]["time_s"] for name in STAGES},
            "total_s": sum(stage["time_s"] for stage in stages.values())}


def sign_split(results_file: str) -> dict:
    """Of a stage's greedy answers to the test problems (its eval_results.jsonl): the share right but for the
    sign, the share of negative answers right, and how many negative answers were given a minus sign."""
    with open(results_file) as f:
        rows = [json.loads(line) for line in f]
    negative = [r for r in rows if r["ground_truth"].startswith("-")]
    unsigned = sum(r["response"].strip().lstrip("-") == r["ground_truth"].lstrip("-") for r in rows)
    return {"unsigned": unsigned / len(rows),
            "negative": sum(r["score"] >= 1 for r in negative) / len(negative),
            "minus": sum(r["response"].strip().startswith("-") for r in negative), "negatives": len(negative)}


def sign_table(runs: list[tuple[int, int, str]]) -> str:
    """What RL adds, per run: the sign of negative answers, after SFT (its eval) and after RL (the eval stage)."""
    lines = ["| seed | threads | after SFT: right but for the sign | negatives right | given a minus | after RL: "
             "right but for the sign | negatives right | given a minus |", "|---|---|---|---|---|---|---|---|"]
    for seed, threads, out in runs:
        sft, rl = (sign_split(os.path.join(out, stage, "eval_results.jsonl")) for stage in ("sft", "eval"))
        lines.append(f"| {seed} | {threads} | " + " | ".join(
            f"{s['unsigned']:.1%} | {s['negative']:.1%} | {s['minus']} of {s['negatives']}" for s in (sft, rl)) + " |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    lines = ["| seed | threads | pretrain (raw text) | sft | rlvr | RL's gain | pretrain s | sft s | rlvr s "
             "| stages s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['seed']} | {r['threads']} | {r['raw']:.1%} | {r['sft']:.1%} | {r['rlvr']:.1%} | "
                     f"{r['gain'] * 100:+.1f} pt | {r['pretrain_s']:.0f} | {r['sft_s']:.0f} | {r['rlvr_s']:.0f} | "
                     f"{r['total_s']:.0f} |")
    spans = [f"{label}: {min(r[key] for r in rows):.1%} to {max(r[key] for r in rows):.1%}"
             for key, label in (("raw", "pretrain (raw text)"), ("sft", "sft"), ("rlvr", "rlvr"))]
    gains = [r["gain"] * 100 for r in rows]
    return "\n".join([*lines, "", f"Ranges over {len(rows)} runs: {'; '.join(spans)}; "
                      f"RL's gain {min(gains):+.1f} to {max(gains):+.1f} pt."])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    parser.add_argument("--out", default="runs/arith-spread")
    parser.add_argument("--report", action="store_true", help="table the finished runs only, running none")
    args = parser.parse_args()
    data = os.path.join(args.out, "data")
    grid = [(seed, threads, os.path.join(args.out, f"seed{seed}-threads{threads}"))
            for seed in args.seeds for threads in args.threads]
    for seed, threads, out in grid if not args.report else ():
        run(out, data, seed, threads)
    rows = [row(seed, threads, out, data, summary) for seed, threads, out in grid
            if (summary := finished(out)) is not None]
    if not rows:
        sys.exit(f"no finished run under {args.out}")
    finished_runs = [(seed, threads, out) for seed, threads, out in grid if finished(out) is not None]
    text = table(rows) + "\n\n" + sign_table(finished_runs)
    with open(os.path.join(args.out, "spread.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
