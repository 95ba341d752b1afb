"""The planner's estimate beside a measured rank at the model's full size: rank 0 of each layout
alone, its peers torch's fake process group, random weights (`StepShape.one_rank`), in fp32
on the CPU or bf16 over fp32 masters on one GPU (`--device cuda`); a model directory needs only
its config.json.

    .venv/bin/python benchmarks/plan_full_size.py --model examples/plan/qwen2.5-7b \
        --layout dp_shard=64 --layout dp_shard=16,tp=4 --layout dp_shard=64,activation_checkpointing=1

Layouts with pp or ep are refused (their collectives exchange sizes, which a fake group cannot carry).
"""

from __future__ import annotations

import argparse

from memory import parse_layout

from rlsys.config.loader import ConfigError
from rlsys.models.directory import read_model_config
from rlsys.parallel.parallelize import check_layout
from rlsys.planner.check import check_full_size, full_size_table
from rlsys.planner.estimate import layout_of
from rlsys.planner.measure import StepShape


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a model directory (config.json is enough)")
    parser.add_argument("--layout", action="append", type=parse_layout, required=True,
                        help="e.g. dp_shard=8,tp=8 (repeatable)")
    parser.add_argument("--rows", type=int, default=1, help="rows per data-parallel rank")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: fp32; cuda: one GPU, bf16 compute over fp32 masters")
    args = parser.parse_args()
    step = StepShape(rows=args.rows, seq_len=args.seq_len, steps=2, device=args.device, one_rank=True)
    config = read_model_config(args.model, "--model")
    for layout in args.layout:  # refused before any is run: a run takes minutes
        try:
            check_layout(layout_of(**layout).parallel, config)
        except ConfigError as err:
            parser.error(f"--layout {layout}: {err}")
    rows = []
    for layout in args.layout:
        rows.append(check_full_size(args.model, layout_of(**layout), step))
        print(full_size_table(rows[-1:]), flush=True)
    print(f"\n{args.rows} x {args.seq_len} tokens a rank, the second step measured\n")
    print(full_size_table(rows))


if __name__ == "__main__":
    main()
