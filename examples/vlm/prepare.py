"""Write the vision-language example's tiny Qwen2-VL (random weights) and its dot-counting data.

    python examples/vlm/prepare.py --out runs/vlm
"""

from __future__ import annotations

import argparse
import os

from rlsys.models.tiny_vl import write_tiny_vl_model
from rlsys.tasks.dots import write_splits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/vlm")
    out = parser.parse_args().out
    model_dir = os.path.join(out, "tiny-vl-init")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        write_tiny_vl_model(model_dir)
    print(f"tiny VL model: {model_dir}")
    for kind, path in write_splits(os.path.join(out, "data")).items():
        print(f"{kind:9s} {path}")


if __name__ == "__main__":
    main()
