"""Write the arithmetic example's data splits and the randomly initialised tiny model.

    python examples/arith/prepare.py --out runs/arith
"""

from __future__ import annotations

import argparse
import os

from rlsys.models.tiny import write_tiny_model
from rlsys.tasks.arith import ArithSpec, write_splits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/arith")
    args = parser.parse_args()
    model_dir = os.path.join(args.out, "tiny-init")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        write_tiny_model(model_dir)
    files = write_splits(os.path.join(args.out, "data"), ArithSpec())
    print(f"tiny model: {model_dir}")
    for kind, path in files.items():
        print(f"{kind:9s} {path}")


if __name__ == "__main__":
    main()
