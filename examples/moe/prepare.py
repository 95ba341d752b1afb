"""Write the MoE example's tiny Qwen3-MoE model and the arithmetic data splits.

The model has the arithmetic example's shape with a mixture of 8 experts in every layer, 2 of
them per token, each half as wide as the dense model's MLP: the same parameters per token.

    python examples/moe/prepare.py --out runs/moe
"""

from __future__ import annotations

import argparse
import os
import sys

from rlsys.models.tiny import TinyModelSpec

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "arith"))
from prepare import prepare  # noqa: E402  (the arithmetic example's)

MOE = TinyModelSpec(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=TinyModelSpec().intermediate_size // 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/moe")
    prepare(parser.parse_args().out, MOE, "tiny-moe-init")


if __name__ == "__main__":
    main()
