"""Pipeline bubble and memory: step time of pp=2 for 1, 2, 4 and 8 micro-batches beside the
bubble fraction (p - 1) / (m + p - 1) the schedule predicts, and each rank's peak memory
under GPipe and 1F1B, with one unpipelined rank on the same batch as the reference.

    .venv/bin/python benchmarks/pipeline.py

`ideal` is the reference step time split over p stages and stretched by the bubble,
t_1 / p / (1 - bubble); `efficiency` is ideal over measured. Each configuration runs in its
own gloo process group (one thread per rank), a warm-up step first, then the mean of
`--steps` steps (forward, backward, optimizer).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
from memory import write_model  # noqa: E402

from rlsys.algorithms.lm_loss import nll_loss  # noqa: E402
from rlsys.config.layout import ParallelConfig  # noqa: E402
from rlsys.config.model import ModelConfig  # noqa: E402
from rlsys.config.training import OptimConfig  # noqa: E402
from rlsys.parallel.dims import ParallelDims  # noqa: E402
from rlsys.planner.measure import CpuAllocations  # noqa: E402
from rlsys.trainer.rank_model import RankModel, RankModelSpec  # noqa: E402


def run_rank(rank: int, layout: dict, model_dir: str, port: int, batch_shape: tuple[int, int], steps: int,
             results) -> None:
    torch.set_num_threads(1)
    parallel = ParallelConfig(**layout)
    dims = ParallelDims.of(parallel)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=dims.world_size)
    rows, length = batch_shape
    spec = RankModelSpec(ModelConfig(path=model_dir), OptimConfig(), dims, parallel, micro_batch_size=rows,
                         total_steps=steps + 1, param_dtype=None)
    rank_model = RankModel(spec, dims.build_mesh("cpu"), torch.device("cpu"))
    ids = torch.randint(0, 1000, (rows, length), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    loss_fn = nll_loss(int(batch["loss_mask"][:, 1:].sum()))
    rank_model.forward_backward(batch, loss_fn)
    rank_model.optimizer_step()
    dist.barrier()
    started = time.perf_counter()
    for _ in range(steps):
        rank_model.forward_backward(batch, loss_fn)
        rank_model.optimizer_step()
    dist.barrier()
    elapsed = (time.perf_counter() - started) / steps
    with CpuAllocations() as memory:  # one step more, apart from the timed ones: the profiler slows it
        with memory.window("step"):
            rank_model.forward_backward(batch, loss_fn)
            rank_model.optimizer_step()
    results.put((rank, elapsed, memory.peaks["step"]))
    dist.destroy_process_group()


def measure(layout: dict, model_dir: str, batch_shape: tuple[int, int], steps: int) -> tuple[float, list[int]]:
    """Step time (slowest rank) and each rank's peak tensor bytes in a step above what it held after
    the warm-up step."""
    world = ParallelDims.of(ParallelConfig(**layout)).world_size
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.Queue()
    procs = [context.Process(target=run_rank, args=(r, layout, model_dir, port, batch_shape, steps, results))
             for r in range(world)]
    for p in procs:
        p.start()
    by_rank = {rank: (elapsed, peak) for rank, elapsed, peak in (results.get(timeout=1800) for _ in procs)}
    for p in procs:
        p.join()
    return max(t for t, _ in by_rank.values()), [by_rank[r][1] for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args()
    pp = 2
    with tempfile.TemporaryDirectory() as model_dir:
        count = write_model(model_dir, args.hidden, args.layers, heads=4, kv_heads=2,
                            intermediate=args.hidden * 3, vocab=8192, tied=False)
        shape = (args.rows, args.seq_len)
        reference, _ = measure({}, model_dir, shape, args.steps)
        print(f"model: {count / 1e6:.1f} M parameters, {args.layers} layers; batch {args.rows} x {args.seq_len} "
              f"tokens; one unpipelined rank: {reference:.3f} s/step\n")
        print("| schedule | micro-batches | bubble (p-1)/(m+p-1) | s/step | ideal s/step | efficiency "
              "| peak MiB rank 0 | peak MiB rank 1 |")
        print("|---|---|---|---|---|---|---|---|")
        for schedule in ("gpipe", "1f1b"):
            for m in args.microbatches:
                if schedule == "1f1b" and m < pp:
                    continue  # 1F1B needs a micro-batch per stage
                layout = {"pp": pp, "pp_schedule": schedule, "pp_microbatches": m}
                elapsed, peaks = measure(layout, model_dir, shape, args.steps)
                bubble = (pp - 1) / (m + pp - 1)
                ideal = reference / pp / (1 - bubble)
                print(f"| {schedule} | {m} | {bubble:.2f} | {elapsed:.3f} | {ideal:.3f} | {ideal / elapsed:.2f} "
                      f"| {peaks[0] / 2**20:.0f} | {peaks[1] / 2**20:.0f} |", flush=True)


if __name__ == "__main__":
    main()
