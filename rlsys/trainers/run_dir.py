"""The output directory's fixed files: config.yaml, summary.json, hf_model/."""

from __future__ import annotations

import json
import os

import yaml

from rlsys.config.loader import config_to_dict

HF_MODEL_DIR = "hf_model"
CONFIG_FILE = "config.yaml"
SUMMARY_FILE = "summary.json"


def prepare_run_dir(cfg, stage: str) -> dict:
    """Create output_dir and write the resolved config; it re-runs as `--config`."""
    os.makedirs(cfg.output_dir, exist_ok=True)
    config = config_to_dict(cfg)
    with open(os.path.join(cfg.output_dir, CONFIG_FILE), "w") as f:
        f.write(f"# resolved config of: python -m rlsys.run {stage} --config {CONFIG_FILE}\n")
        yaml.safe_dump(config, f, sort_keys=False)
    return config


def write_summary(output_dir: str, summary: dict) -> None:
    with open(os.path.join(output_dir, SUMMARY_FILE), "w") as f:
        json.dump(summary, f, indent=2)
