"""Write the calculator example's model and data under --out (default runs/calc).

    .venv/bin/python examples/calc/prepare.py --out runs/calc
"""

from __future__ import annotations

import argparse
import os

from rlsys.models.tiny import write_tiny_model
from rlsys.tasks.calc import CalcSpec, write_splits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/calc")
    parser.add_argument("--tool-share", type=float, default=CalcSpec.tool_share,
                        help="the share of fine-tuning traces that call the calculator (the rest answer at once)")
    parser.add_argument("--num-sft", type=int, default=CalcSpec.num_sft, help="fine-tuning traces")
    args = parser.parse_args()
    if not os.path.isdir(os.path.join(args.out, "tiny-init")):
        write_tiny_model(os.path.join(args.out, "tiny-init"))
    spec = CalcSpec(num_sft=args.num_sft, tool_share=args.tool_share)
    for name, path in write_splits(os.path.join(args.out, "data"), spec).items():
        print(f"{name:9s} {path}")


if __name__ == "__main__":
    main()
