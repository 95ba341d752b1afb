"""Does a change keep RL's behaviour? Runs 3 steps of the RL configs below on this checkout and on a
reference commit (a git worktree of it), then compares their metrics.jsonl: every logged number but
the timings equal to 1e-6 (relative above 1), the steps and keys identical.

    .venv/bin/python scripts/same_metrics.py --ref 048dd53 [--only grpo dapo ...] [--reuse]

A case is the arithmetic example's GRPO stage (examples/arith/rlvr.yaml, on the tiny model of
`--model`) with a feature's keys set, or another example's RL config (the calculator's, the real
model's, the vision-language model's) on its own model; `--reuse` keeps the reference
commit's finished runs (they only need making once); `--report` compares the runs on disk. Prints a
table, one line a case.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["train.steps=3", "train.prompts_per_step=8", "rollout.n=4", "train.val_every=0", "train.save_every=0",
         "tracking.backends=[jsonl]", "tracking.trace=false", "tracking.log_samples_every=0"]
ARITH = "examples/arith/rlvr.yaml"
CASES: dict[str, tuple[str, str, list[str]]] = {
    # name: (config, the model it starts from (a --flag below), its keys)
    "grpo": (ARITH, "model", []),
    "lora": ("examples/arith/rlvr_lora.yaml", "model", []),
    "dapo": (ARITH, "model", ["algorithm.filter_groups=true", "algorithm.max_sampling_rounds=3",
                              "reward.overlong_buffer_len=2", "rollout.max_new_tokens=6"]),
    "remax": (ARITH, "model", ["algorithm.adv_estimator=remax"]),
    "ppo_gae": (ARITH, "model", ["algorithm.adv_estimator=gae", "algorithm.lam=0.95", "algorithm.ppo_epochs=2",
                                 "algorithm.ppo_mini_batch_size=4"]),
    "kl": (ARITH, "model", ["algorithm.kl_coef=0.01", "algorithm.use_kl_in_reward=true"]),
    "otb": (ARITH, "model", ["algorithm.adv_estimator=optimal_token_baseline",
                             "algorithm.rollout_correction.rollout_is=token"]),
    "rollout_correction": (ARITH, "model", ["algorithm.rollout_correction.rollout_is=sequence",
                                            "algorithm.rollout_correction.rollout_is_batch_normalize=true",
                                            "algorithm.rollout_correction.rollout_rs=token"]),
    "distill_top_k": (ARITH, "model", ["algorithm.distill.teacher={teacher}", "algorithm.distill.top_k=4",
                                       "algorithm.distill.source=trainer"]),
    "distill_penalty": (ARITH, "model", ["algorithm.distill.teacher={teacher}", "algorithm.distill.mode=penalty",
                                         "algorithm.distill.serving.engine_memory_gib=0.1"]),
    "async_one_step": (ARITH, "model", ["train.async_mode=one_step", "rollout.placement=separate",
                                        "ray.cpus_per_worker=1"]),
    "r2_moe": (ARITH, "moe_model", ["algorithm.router_replay=r2", "parallel.dp_shard=2", "parallel.ep=2"]),
    "tools": ("examples/calc/rlvr_tools.yaml", "calc_model", []),
    "openai": ("examples/calc/rlvr_openai.yaml", "calc_model", []),
    "compact": ("examples/calc/rlvr_compact.yaml", "calc_model", []),
    "no_tools": ("examples/calc/rlvr_no_tools.yaml", "calc_model", []),
    "smollm": ("examples/smollm/rlvr.yaml", "smollm_model", []),
    "smollm_lora": ("examples/smollm/rlvr.yaml", "smollm_model", ["model.lora.rank=16", "model.lora.alpha=32",
                                                                  "optim.lr=1.0e-4"]),
    "vlm": ("examples/vlm/rlvr.yaml", "vlm_model", []),
    "vlm_lora": ("examples/vlm/rlvr_lora.yaml", "vlm_model", []),
}
MODEL_FLAGS = ("model", "teacher", "calc_model", "moe_model", "smollm_model", "vlm_model")
MACHINE = ("time/", "memory/", "perf/", "startup/", "throughput/", "rollout/freed_gib")
"""Keys that measure the machine, not the algorithm: these prefixes, and any seconds (`sync/time_s`)."""


def measures_machine(key: str) -> bool:
    name = key.rsplit("/", 1)[-1]
    return key.startswith(MACHINE) or name.endswith("_s") or "_s_" in name


def run_case(tree: str, out: str, name: str, models: dict[str, str]) -> str:
    """Run case `name` in checkout `tree` into `out/name` (`models`: the paths of the model flags);
    returns its metrics.jsonl."""
    config, model, keys = CASES[name]
    run_dir = os.path.join(out, name)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    policy = models[model]
    overrides = [key.format(teacher=models["teacher"]) for key in keys]
    command = [sys.executable, "-m", "rlsys.run", "rlvr", "--config", config, *SMALL, *overrides,
               f"model.path={policy}", f"output_dir={run_dir}"]
    if config.startswith("examples/arith"):
        command.append(f"data.train_files=[{os.path.join(ROOT, 'runs/arith/data/rl_train.parquet')}]")
    if not os.path.isdir(policy):
        raise SystemExit(f"same_metrics: case {name}: no model at {policy} (see --{model.replace('_', '-')})")
    result = subprocess.run(command, cwd=tree, env={**os.environ, "PYTHONPATH": tree}, capture_output=True,
                            text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{name} in {tree}: exit {result.returncode}: {result.stderr.strip()[-400:]}")
    return metrics


def read_rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def compare(ours: list[dict], theirs: list[dict]) -> tuple[int, float, list[str]]:
    """(numbers compared, largest difference, what differs)."""
    differs, largest, compared = [], 0.0, 0
    if [r.get("step") for r in ours] != [r.get("step") for r in theirs]:
        return 0, math.inf, ["steps"]
    for a, b in zip(ours, theirs):
        keys_a = {k for k in a if not measures_machine(k)}
        keys_b = {k for k in b if not measures_machine(k)}
        differs += [f"step {a['step']}: only one side logs {k}" for k in sorted(keys_a ^ keys_b)]
        for key in sorted(keys_a & keys_b):
            x, y = a[key], b[key]
            if not isinstance(x, (int, float)) or not isinstance(y, (int, float)):
                continue
            compared += 1
            if math.isnan(x) and math.isnan(y):
                continue
            gap = abs(x - y) / max(1.0, abs(x))
            largest = max(largest, gap)
            if gap > 1e-6:
                differs.append(f"step {a['step']} {key}: {x} vs {y}")
    return compared, largest, differs


def worktree(ref: str, path: str) -> str:
    if not os.path.isdir(path):
        subprocess.run(["git", "worktree", "add", "--detach", path, ref], cwd=ROOT, check=True, capture_output=True)
        os.symlink(os.path.realpath(os.path.join(ROOT, "runs")), os.path.join(path, "runs"))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ref", required=True, help="the commit to compare with")
    parser.add_argument("--only", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--out", default="runs/same-metrics")
    parser.add_argument("--model", default="runs/arith-spread/seed0-threads1/sft/hf_model")
    parser.add_argument("--teacher", default="runs/arith-spread/seed0-threads1/rlvr/hf_model")
    parser.add_argument("--calc-model", default="runs/calc/sft/hf_model")
    parser.add_argument("--moe-model", default="runs/moe/tiny-moe-init", help="examples/moe/prepare.py's")
    parser.add_argument("--smollm-model", default="runs/smollm/model", help="examples/smollm/prepare.py's")
    parser.add_argument("--vlm-model", default="runs/vlm/sft/hf_model", help="examples/vlm/sft.yaml's")
    parser.add_argument("--reuse", action="store_true", help="keep the reference commit's finished runs")
    parser.add_argument("--report", action="store_true", help="compare the runs on disk, running none")
    args = parser.parse_args()
    ref = subprocess.run(["git", "rev-parse", "--short", args.ref], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    trees = {"here": ROOT, ref: ROOT if args.report else worktree(ref, os.path.join("/tmp", f"rlsys-ref-{ref}"))}
    paths = {k: os.path.abspath(getattr(args, k)) for k in MODEL_FLAGS}
    print("| case | numbers compared | largest difference | verdict |\n|---|---|---|---|")
    failed = False
    for name in args.only:
        metrics = {}
        for side, tree in trees.items():
            out = os.path.abspath(os.path.join(args.out, side))
            done = os.path.join(out, name, "summary.json")
            if not args.report and not (args.reuse and side == ref and os.path.isfile(done)):
                subprocess.run(["rm", "-rf", os.path.join(out, name)], check=True)
                run_case(tree, out, name, paths)
            metrics[side] = read_rows(os.path.join(out, name, "metrics.jsonl"))
        compared, largest, differs = compare(metrics["here"], metrics[ref])
        failed |= bool(differs)
        verdict = "same" if not differs else "; ".join(differs[:3])
        print(f"| {name} | {compared} | {largest:.1e} | {verdict} |", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
