"""Writing a task's rows: JSONL for SFT and pretraining, Parquet (VeRL's RL schema) through `datasets`."""

from __future__ import annotations

import json
import os


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
