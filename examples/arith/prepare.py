"""Write the arithmetic example's data splits and the randomly initialised tiny model.

    python examples/arith/prepare.py --out runs/arith
"""

from __future__ import annotations

import argparse
import os

from rlsys.models.tiny import TinyModelSpec, write_tiny_model
from rlsys.tasks.arith import ArithSpec, write_splits


TASK = ArithSpec(sign_slips=0.75)
"""The main job's task: its SFT answers come from a careless teacher who drops the minus sign of three
in four negative results (a quarter of the problems), which SFT imitates and RL's verifier corrects."""


def prepare(out: str, spec: TinyModelSpec = TinyModelSpec(), model_name: str = "tiny-init",
            data_dir: str | None = None) -> None:
    """The model under `out`/`model_name` (kept if written before) and the splits under `data_dir`
    (default `out`/data)."""
    model_dir = os.path.join(out, model_name)
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        write_tiny_model(model_dir, spec)
    files = write_splits(data_dir or os.path.join(out, "data"), TASK)
    print(f"tiny model: {model_dir}")
    for kind, path in files.items():
        print(f"{kind:9s} {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/arith")
    prepare(parser.parse_args().out)


if __name__ == "__main__":
    main()
