"""Where MoE routing replay matters: the same RL job on a random Qwen3-MoE model with several
mini-batches per step (off-policy updates inside the step), without replay, with R2 and (on a GPU, where
vLLM returns the engine's routing) with R3, run one after the other in one process, and per run the
mean over its steps of how far the update's policy moved from the old one on the tokens it trained
(`actor/log_ratio_abs`, `actor/ppo_kl`), how many tokens PPO clipped, the engine/trainer log-prob
mismatch of the old-log-prob pass (`mismatch/*`), and with replay the share of (token, layer) pairs
whose replayed experts the update's routers would have chosen themselves
(`router/replay_agreement`) and, with R3, the share the trainer's routers chose as the engine's did
on the weights that sampled (`router/engine_agreement`, the old-log-prob pass). Step 1 of every run
trains on the same samples (the same seed and weights); later steps differ. Arguments after the
options are overrides for every run.

    .venv/bin/python benchmarks/router_replay.py --data runs/arith/data/rl_train.parquet
    python benchmarks/router_replay.py ray.gpus_per_worker=1 --data ... --replays none r3   # on a GPU

A random model earns no arithmetic reward, so the job is rewarded by a fair coin on the
response text (`compute_score` below): advantages that differ, and updates that move the
routers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import zlib

import rlsys.tasks  # noqa: F401  (registers the `arith` reward, for a trained model's runs)

FIGURES = ("actor/log_ratio_abs", "actor/ppo_kl", "actor/clip_frac", "router/replay_agreement",
           "router/engine_agreement", "mismatch/kl_k3", "mismatch/abs_log_ratio_p50", "mismatch/abs_log_ratio_p99",
           "mismatch/abs_log_ratio_max", "time/update_s")


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """The reward: a fair coin on the response text."""
    return float(zlib.crc32(solution_str.encode()) % 2)


def run(args, replay: str) -> dict[str, float]:
    from rlsys.config.loader import load_config
    from rlsys.config.schema import RLJobConfig
    from rlsys.stages.rl_trainer import run_rlvr

    out = os.path.join(args.out, replay)
    cfg = load_config(RLJobConfig, None, [
        f"output_dir={out}", f"model.path={args.model}", f"data.train_files=[{args.data}]",
        f"reward.terms=[{{path: {os.path.abspath(__file__)}}}]", "rollout.n=4", "rollout.max_new_tokens=16",
        "rollout.engine_memory_gib=0.25", f"train.steps={args.steps}", "train.prompts_per_step=16",
        "train.micro_batch_size=16", "train.save_every=0", "train.val_every=0", "train.resume=false", "eval=null",
        "optim.lr=3e-3", "algorithm.ppo_mini_batch_size=4", "algorithm.ppo_epochs=2",
        f"algorithm.router_replay={replay}", "parallel.dp_shard=1", "ray.include_dashboard=false",
        "tracking.backends=[jsonl]", f"seed={args.seed}", *args.overrides])
    run_rlvr(cfg)
    import json

    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    steps = [row for row in rows if "actor/clip_frac" in row]
    first = {f"{name} (step 1)": steps[0][name] for name in ("reward/mean", *FIGURES) if name in steps[0]}
    means = {name: statistics.mean(row[name] for row in steps) for name in FIGURES if name in steps[0]}
    return {**first, **means}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="an RL prompt file (examples/arith/prepare.py writes one)")
    parser.add_argument("--model", default="runs/bench/qwen3-moe-random")
    parser.add_argument("--out", default="runs/bench/router_replay")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--replays", nargs="+", default=["none", "r2"], choices=["none", "r2", "r3"])
    parser.add_argument("overrides", nargs="*", help="config overrides for every run, e.g. ray.gpus_per_worker=1")
    args = parser.parse_args()
    if not os.path.isdir(args.model):
        from rlsys.models.tiny import TinyModelSpec, write_tiny_model

        write_tiny_model(args.model, TinyModelSpec(hidden_size=128, num_hidden_layers=4, num_experts=16,
                                                   num_experts_per_tok=2, moe_intermediate_size=64))
    results = {replay: run(args, replay) for replay in args.replays}
    print(f"\n[router_replay] {args.model}, {args.steps} steps of 16 prompts x 4 responses, "
          f"4 mini-batches x 2 epochs a step; step 1 (the same samples in every run: the same reward), then "
          f"means over the steps (the runs' samples differ from step 2 on):\n")
    names = list(dict.fromkeys(name for figures in results.values() for name in figures))
    print("  | figure | " + " | ".join(args.replays) + " |")
    print("  |---|" + "---|" * len(args.replays))
    for name in names:
        cells = [f"{results[replay][name]:.4g}" if name in results[replay] else "-" for replay in args.replays]
        print(f"  | {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
