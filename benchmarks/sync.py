"""Weight-sync throughput beside a memory copy of the same bytes, measured in one run.

    .venv/bin/python benchmarks/sync.py                      # Qwen2.5-0.5B-shaped, random init
    .venv/bin/python benchmarks/sync.py --model runs/arith/sft/hf_model parallel.tp=2 parallel.dp_shard=1
    .venv/bin/python benchmarks/sync.py --release          # the engine frees its weights first, as in the RL loop
    .venv/bin/python benchmarks/sync.py rollout.sync_mode=object_store     # through Ray's object store
    .venv/bin/python benchmarks/sync.py rollout.sync_mode=gathered rollout.num_engines=2   # an engine per rank
    .venv/bin/python benchmarks/sync.py model.lora.rank=16                 # LoRA: the adapters alone

Builds the training group (any layout, given as config overrides) and its colocated
vLLM engines (one unless `rollout.num_engines` says more), runs the trainer -> engine
sync `--repeats` times and prints its median time and MB/s, then the median time of
copying the same number of bytes from one tensor into another in this process, on the
device the shards are on (torch's copy: all threads on CPU, a device-to-device copy on
a GPU): the floor of any path.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from rlsys.config.loader import load_config
from rlsys.config.schema import RLJobConfig

QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=512)


def ensure_model(path: str) -> None:
    from rlsys.models.tiny import TinyModelSpec, write_tiny_model

    if not os.path.isdir(path):
        print(f"writing a random Qwen2.5-0.5B-shaped model to {path}")
        write_tiny_model(path, TinyModelSpec(**QWEN25_05B))


def sync_times(cfg: RLJobConfig, repeats: int, release: bool) -> tuple[list[float], dict[str, float]]:
    from rlsys.actors.cluster import ensure_ray, gpu_shares
    from rlsys.actors.rollout_group import RolloutGroup
    from rlsys.actors.train_group import TrainGroup
    from rlsys.actors.train_worker import build_worker_spec
    from rlsys.rl.adapter_sync import AdapterSync
    from rlsys.rl.weight_sync import WeightSync
    from rlsys.rollout.adapters import AdapterSpec
    from rlsys.rollout.vllm_engine import synced_weight_dtype

    ensure_ray(cfg.ray)
    train_gpus, engine_gpus = gpu_shares(cfg.ray.gpus_per_worker, int(cfg.rollout.placement == "colocated"))
    train = TrainGroup(build_worker_spec(cfg, 1, 1), cfg.ray, gpu_share=train_gpus)
    rollout = None
    try:
        rollout = RolloutGroup(cfg.model.path, cfg.rollout, cfg.seed, train.placement,
                               cfg.ray.cpus_per_worker * train.dims.world_size, gpu_share=engine_gpus,
                               adapter=AdapterSpec.of(cfg.model.lora), fp32_head=cfg.model.fp32_lm_head)
        sync = AdapterSync(train, rollout) if cfg.model.lora.syncs_adapters else \
            WeightSync(train, rollout, cfg.rollout.sync_bucket_mb, cfg.rollout.sync_mode,
                       [rollout.placement.ranks_beside(i) for i in range(len(rollout.actors))],
                       synced_weight_dtype(cfg.rollout.dtype, train.on_gpu, cfg.model.fp32_lm_head))
        runs = []
        for _ in range(repeats + 1):
            if release:
                rollout.release_memory()
            runs.append(sync.run())
    finally:
        for group in (rollout, train):
            if group is not None:
                group.shutdown()
    return [r["sync/time_s"] for r in runs[1:]], runs[-1]


def memcpy_time(nbytes: int, device: str, repeats: int = 5) -> float:
    """Median seconds to copy `nbytes` from one tensor into another on `device` (where the shards are)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="runs/bench/qwen2.5-0.5b-random")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--release", action="store_true",
                        help="the engine frees its weights before each sync, as a colocated engine does in the RL loop")
    parser.add_argument("overrides", nargs="*", help="rlsys config overrides (key=value), e.g. parallel.tp=2")
    args = parser.parse_args()
    ensure_model(args.model)
    cfg = load_config(RLJobConfig, None, [
        "output_dir=runs/bench/sync", f"model.path={args.model}", "data.train_files=[unused.parquet]",
        "parallel.dp_shard=2", "rollout.engine_memory_gib=0.25", "ray.include_dashboard=false", *args.overrides])
    times, last = sync_times(cfg, args.repeats, args.release)
    seconds, mb = statistics.median(times), last["sync/mb"]
    device = "cuda" if cfg.ray.gpus_per_worker and torch.cuda.is_available() else "cpu"
    floor = memcpy_time(int(mb * 2**20), device)
    where = "through CUDA IPC" if device == "cuda" else "from shared memory"
    how = f"read in place {where}" if last["sync/in_place"] else f"in {last['sync/buckets']:.0f} buckets"
    if last.get("sync/gathered"):
        how += " gathered by the ranks, each engine reading its own rank's " + \
            ("GPU through CUDA IPC" if device == "cuda" else "shared memory")
    how += f" (LoRA rank {cfg.model.lora.rank} adapters)" if cfg.model.lora.rank else ""
    print(f"\nweight sync of {mb:,.1f} MB {how} "
          f"({cfg.parallel.dp_shard} dp_shard x {cfg.parallel.tp} tp x {cfg.parallel.pp} pp -> "
          f"{cfg.rollout.num_engines} engine{'s' if cfg.rollout.num_engines > 1 else ''}"
          f"{', weights freed before each' if args.release else ''}), "
          f"median of {args.repeats}:")
    print(f"  sync    {seconds:8.3f} s  {mb / seconds:10,.0f} MB/s")
    print(f"  memcpy  {floor:8.3f} s  {mb / floor:10,.0f} MB/s   (same bytes, one process, {device})")
    print(f"  sync / memcpy time: {seconds / floor:.1f}x")


if __name__ == "__main__":
    main()
