"""Writing a task's rows: JSONL for SFT and pretraining, Parquet (VeRL's RL schema) through `datasets`."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable


def write_jsonl(out_dir: str, name: str, rows: list[dict]) -> str:
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return path


def write_parquet(out_dir: str, name: str, rows: list[dict]) -> str:
    import datasets

    path = os.path.join(out_dir, name)
    datasets.Dataset.from_list(rows).to_parquet(path)
    return path


def splits_command(write_splits: Callable[[str], dict[str, str]], doc: str, argv: list[str] | None = None) -> None:
    """A task's command line: `--out DIR`, then the path of each split written there."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    for name, path in write_splits(parser.parse_args(argv).out).items():
        print(f"{name:9s} {path}")
