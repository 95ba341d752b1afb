"""The output directory's fixed files: config.yaml, summary.json, hf_model/, report.*"""

from __future__ import annotations

import json
import logging
import os

import yaml

from rlsys.config.loader import config_to_dict

log = logging.getLogger(__name__)

HF_MODEL_DIR = "hf_model"
CONFIG_FILE = "config.yaml"
SUMMARY_FILE = "summary.json"


def prepare_run_dir(cfg, stage: str) -> dict:
    """Create output_dir, write the resolved config (it re-runs as `--config`) and send
    the driver's and the actors' logs to output_dir/logs/."""
    from rlsys.actors.cluster import set_log_dir
    from rlsys.console import attach_run_log

    os.makedirs(cfg.output_dir, exist_ok=True)
    set_log_dir(attach_run_log(cfg.output_dir))
    config = config_to_dict(cfg)
    with open(os.path.join(cfg.output_dir, CONFIG_FILE), "w") as f:
        f.write(f"# resolved config of: python -m rlsys.run {stage} --config {CONFIG_FILE}\n")
        yaml.safe_dump(config, f, sort_keys=False)
    return config


def logged_metric(output_dir: str, step: int, name: str) -> float | None:
    """`name` as the run's metrics.jsonl logged it at `step` (None when it did not): what a resumed
    run reads of the attempt it resumes, such as the validation before the first step."""
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if row.get("step") == step and name in row:
                return row[name]
    return None


def write_summary(output_dir: str, summary: dict) -> None:
    with open(os.path.join(output_dir, SUMMARY_FILE), "w") as f:
        json.dump(summary, f, indent=2)


def finish_run(output_dir: str, summary: dict) -> None:
    """Write summary.json (it marks the run finished), then the run report."""
    from rlsys.report import write_report

    write_summary(output_dir, summary)
    try:
        log.info("report: %s", write_report(output_dir))
    except Exception:  # a plotting problem must not fail a finished run
        log.warning("could not write the run report for %s", output_dir, exc_info=True)
