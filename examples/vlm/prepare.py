"""Write the vision-language example's tiny model (random weights; a Qwen2-VL unless `--family`
names another) and its dot-counting data.

    python examples/vlm/prepare.py --out runs/vlm [--family qwen2_5_vl]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from rlsys.models.tiny_vl import TinyVLSpec, write_tiny_vl_model
from rlsys.models.vision import VL_FAMILIES
from rlsys.tasks.dots import write_splits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/vlm")
    parser.add_argument("--family", choices=VL_FAMILIES, default="qwen2_vl")
    args = parser.parse_args()
    model_dir = os.path.join(args.out, "tiny-vl-init")
    written = written_family(model_dir)
    if written not in (None, args.family):  # the pipeline would skip the stages that ran on that model
        sys.exit(f"{args.out} holds a run of a {written} model: remove it to start over with {args.family}")
    if written is None:
        write_tiny_vl_model(model_dir, TinyVLSpec(family=args.family))
    print(f"tiny VL model ({args.family}): {model_dir}")
    for kind, path in write_splits(os.path.join(args.out, "data")).items():
        print(f"{kind:9s} {path}")


def written_family(model_dir: str) -> str | None:
    try:
        with open(os.path.join(model_dir, "config.json")) as config:
            return json.load(config)["model_type"]
    except FileNotFoundError:
        return None


if __name__ == "__main__":
    main()
