"""Host memory of writing a Hugging Face directory (a stage's `hf_model/`, `rlsys.run export`): the
rank's resident set while it exports, above what it held before (its own weights), beside the largest
shard it writes. The export converts each tensor to the export dtype and holds a shard's tensors
until the shard is full (at most 5 GB), so it should take about one shard beyond the rank's own.

Each case runs in a process of its own (one rank, gloo), on a random model of the shape named,
exported in fp32 and in bf16:

    .venv/bin/python benchmarks/export_memory.py                       # the 22.7 M model, Qwen2.5-0.5B's shape
    .venv/bin/python benchmarks/export_memory.py --shapes 22.7M --dtypes bfloat16
"""

from __future__ import annotations

import argparse
import glob
import multiprocessing as mp
import os
import tempfile

MIB = 2**20


def export_once(model_dir: str, dtype: str, out_dir: str, results) -> None:
    """Build one rank's model of `model_dir`, then export it in `dtype`, sampling the resident set."""
    import torch
    import torch.distributed as dist

    from rlsys.config.layout import ParallelConfig
    from rlsys.config.model import ModelConfig
    from rlsys.config.training import OptimConfig
    from rlsys.parallel.dims import ParallelDims
    from rlsys.planner.measure import PeakSampler
    from rlsys.trainer.hf_export import export_hf
    from rlsys.trainer.rank_model import RankModel, RankModelSpec

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel = ParallelConfig()
    dims = ParallelDims.of(parallel)
    model = ModelConfig(path=model_dir, export_dtype=dtype)
    rank_model = RankModel(RankModelSpec(model, OptimConfig(), dims, parallel, micro_batch_size=1, total_steps=1,
                                         param_dtype=None),
                           dims.build_mesh("cpu"), torch.device("cpu"))
    own = sum(p.numel() * p.element_size() for _, p in rank_model.named_parameters())
    before = PeakSampler.rss()
    with PeakSampler() as sampler:
        export_hf(rank_model.weights, model, out_dir, 0, 1, writes_stage=True, writes_config=True)
    shards = [os.path.getsize(path) for path in glob.glob(os.path.join(out_dir, "*.safetensors"))]
    results.put({"own": own, "before": before, "growth": sampler.peak - before, "largest": max(shards),
                 "total": sum(shards), "shards": len(shards)})
    dist.destroy_process_group()


def main() -> None:
    from random_model import RANDOM22M
    from sync import QWEN25_05B  # the benchmarks' own shapes (imported here: not in each case's process)

    shapes = {"22.7M": RANDOM22M, "qwen2.5-0.5b": QWEN25_05B}
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(shapes), choices=list(shapes))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    args = parser.parse_args()
    from rlsys.models.tiny import TinyModelSpec, write_tiny_model

    context = mp.get_context("spawn")
    print("| model | export dtype | rank's weights MiB | shards | largest shard MiB | resident set while exporting, "
          "above before, MiB | that / largest shard |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as work:
        for shape in args.shapes:
            model_dir = write_tiny_model(os.path.join(work, shape), TinyModelSpec(**shapes[shape]))
            for dtype in args.dtypes:
                results = context.Queue()
                process = context.Process(target=export_once,
                                          args=(model_dir, dtype, os.path.join(work, f"{shape}-{dtype}"), results))
                process.start()
                row = results.get()
                process.join()
                ratio = row["growth"] / row["largest"]
                print(f"| {shape} | {dtype} | {row['own'] / MIB:,.0f} | {row['shards']} | "
                      f"{row['largest'] / MIB:,.0f} | {row['growth'] / MIB:,.0f} | {ratio:.2f} |", flush=True)


if __name__ == "__main__":
    main()
