"""Write the calculator example's model and data under --out (default runs/calc).

    .venv/bin/python examples/calc/prepare.py --out runs/calc
"""

from __future__ import annotations

import argparse
import os

from rlsys.models.tiny import write_tiny_model
from rlsys.tasks.calc import write_splits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/calc")
    args = parser.parse_args()
    if not os.path.isdir(os.path.join(args.out, "tiny-init")):
        write_tiny_model(os.path.join(args.out, "tiny-init"))
    for name, path in write_splits(os.path.join(args.out, "data")).items():
        print(f"{name:9s} {path}")


if __name__ == "__main__":
    main()
