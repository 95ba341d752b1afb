"""Per-step metrics to every configured backend under the same names, and what the model said.

metrics.jsonl always gets one JSON object per step, with `step`; console,
wandb, tensorboard, mlflow and Ray's metrics (for the dashboard and
Prometheus) are chosen in `tracking.backends`. A step's samples (RL's
responses, `tracking.log_samples_every`) go to samples.jsonl, one object a
response, and to each backend with tables: a wandb Table, TensorBoard text,
an mlflow table artifact.
"""

from __future__ import annotations

import hashlib
import json
import math
import netrc
import os
import re
import sys
import time
import urllib.parse
from collections.abc import Mapping
from typing import Any

from tqdm import tqdm

from rlsys.config.training import TrackingConfig

Metrics = dict[str, float]


class Tracker:
    def __init__(self, cfg: TrackingConfig, output_dir: str, config: dict, total_steps: int, start_step: int = 0,
                 log_every: int = 1):
        run_name = cfg.run_name or os.path.basename(os.path.abspath(output_dir))
        self.backends: list = [JsonlBackend(output_dir, start_step)]
        for name in dict.fromkeys(cfg.backends):
            if name == "console":
                self.backends.append(ConsoleBackend(run_name, total_steps, start_step, log_every))
            elif name == "wandb":
                self.backends.append(WandbBackend(cfg, run_name, output_dir, config))
            elif name == "tensorboard":
                self.backends.append(TensorboardBackend(output_dir))
            elif name == "mlflow":
                self.backends.append(MlflowBackend(cfg, run_name, output_dir, config))
            elif name == "ray":
                self.backends.append(RayMetricsBackend(run_name))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        finite = {name: _plain(value) for name, value in metrics.items()}
        for backend in self.backends:
            backend.log(step, finite)

    def log_samples(self, step: int, records: list[dict]) -> None:
        """`records` (`rlsys.rl.samples`) to every backend that keeps text; after the step's `log`."""
        for backend in self.backends:
            if hasattr(backend, "log_samples"):
                backend.log_samples(step, records)

    def close(self) -> None:
        for backend in self.backends:
            backend.close()


class JsonlBackend:
    """metrics.jsonl, one row a step, and samples.jsonl, one row a logged response (opened at the first)."""

    def __init__(self, output_dir: str, start_step: int):
        self._output_dir, self._start_step = output_dir, start_step
        self._metrics = _open_rows(os.path.join(output_dir, "metrics.jsonl"), start_step)
        samples = os.path.join(output_dir, SAMPLES_FILE)  # a resumed run's, trimmed now: it may log none again
        self._samples = _open_rows(samples, start_step) if os.path.isfile(samples) else None

    def log(self, step: int, metrics: Metrics) -> None:
        _write_row(self._metrics, {"step": step, **metrics})

    def log_samples(self, step: int, records: list[dict]) -> None:
        if self._samples is None:
            self._samples = _open_rows(os.path.join(self._output_dir, SAMPLES_FILE), self._start_step)
        for record in records:
            _write_row(self._samples, {"step": step, **record})

    def close(self) -> None:
        for file in (self._metrics, self._samples):
            if file is not None:
                file.close()


SAMPLES_FILE = "samples.jsonl"


def _open_rows(path: str, start_step: int):
    """A JSON-lines file to append to; a resumed run first drops the rows past the step it resumes from,
    so the file holds the run as it went on (a restart's redone steps once)."""
    kept = []
    if start_step and os.path.isfile(path):
        with open(path) as f:
            kept = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= start_step]
    with open(path, "w") as f:
        f.writelines(kept)
    return open(path, "a")


def _write_row(file, row: dict) -> None:
    file.write(json.dumps(row) + "\n")
    file.flush()


def sample_table(records: list[dict]) -> tuple[list[str], list[list]]:
    """Records as one table, its columns the records' fields with each reward term `reward/<term>`."""
    rows = [{**{k: v for k, v in r.items() if k != "terms"}, **{f"reward/{t}": v for t, v in r["terms"].items()}}
            for r in records]
    columns = list(dict.fromkeys(name for row in rows for name in row))
    return columns, [[_cell(row.get(name)) for name in columns] for row in rows]


def _cell(value: Any) -> Any:
    return json.dumps(value) if isinstance(value, (list, dict)) else value


class ConsoleBackend:
    _KEYS = ("train/loss", "train/grad_norm", "train/lr", "throughput/tokens_per_s", "reward/mean", "val/accuracy")

    def __init__(self, run_name: str, total_steps: int, start_step: int, log_every: int):
        self._bar = tqdm(total=total_steps, initial=start_step, desc=run_name, **_bar_width())
        self._log_every = log_every

    def log(self, step: int, metrics: Metrics) -> None:
        self._bar.update(step - self._bar.n)
        if step % self._log_every == 0:
            self._bar.set_postfix({k: f"{v:.4g}" for k, v in metrics.items() if k in self._KEYS and v is not None})

    def close(self) -> None:
        self._bar.close()


def _bar_width() -> dict:
    """tqdm sizes the bar to the terminal; a pseudo-terminal that reports width 0 (`script`,
    some CI runners) would get an empty bar."""
    try:
        width = os.get_terminal_size(sys.stderr.fileno()).columns
    except OSError:
        return {}  # not a terminal: tqdm's fixed width
    return {"dynamic_ncols": True} if width else {"ncols": 100, "nrows": 24}


class WandbBackend:
    """A wandb run holding the resolved config, named, tagged and grouped as `tracking` says."""

    def __init__(self, cfg: TrackingConfig, run_name: str, output_dir: str, config: dict):
        import wandb

        self._run = wandb.init(project=cfg.project, entity=cfg.entity or None, name=run_name, group=cfg.group or None,
                               tags=cfg.tags or None, dir=output_dir, mode=wandb_mode(cfg.wandb_mode),
                               config=config, resume="allow", id=_stable_id(output_dir))

    def log(self, step: int, metrics: Metrics) -> None:
        self._run.log(_without_none(metrics), step=step)

    def log_samples(self, step: int, records: list[dict]) -> None:
        import wandb

        columns, data = sample_table(records)
        self._run.log({"samples": wandb.Table(columns=["step", *columns], data=[[step, *row] for row in data])},
                      step=step)

    def close(self) -> None:
        self._run.finish()


def wandb_mode(mode: str, environ: Mapping[str, str] = os.environ) -> str:
    """`tracking.wandb_mode` resolved: auto is WANDB_MODE when set, else online when wandb has an API key
    (WANDB_API_KEY, or the entry `wandb login` wrote to the netrc file for WANDB_BASE_URL's host)."""
    if mode != "auto":
        return mode
    if environ.get("WANDB_MODE"):
        return environ["WANDB_MODE"]
    return "online" if environ.get("WANDB_API_KEY") or _netrc_has_key(environ) else "offline"


def _netrc_has_key(environ: Mapping[str, str]) -> bool:
    host = urllib.parse.urlparse(environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    path = environ.get("NETRC") or os.path.join(environ.get("HOME") or os.path.expanduser("~"), ".netrc")
    try:
        entry = netrc.netrc(path).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])


class TensorboardBackend:
    def __init__(self, output_dir: str):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(os.path.join(output_dir, "tensorboard"))

    def log(self, step: int, metrics: Metrics) -> None:
        for name, value in _without_none(metrics).items():
            self._writer.add_scalar(name, value, step)

    def log_samples(self, step: int, records: list[dict]) -> None:
        """A markdown table, which TensorBoard's text tab renders."""
        columns, data = sample_table(records)
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(_markdown_cell(cell) for cell in row) + " |" for row in data]
        self._writer.add_text("samples", "\n".join(lines), step)

    def close(self) -> None:
        self._writer.close()


class MlflowBackend:
    """A run in `tracking.mlflow_uri` (default: a SQLite store at output_dir/mlflow.db, artifacts in
    output_dir/mlartifacts); a resumed run continues the same mlflow run."""

    def __init__(self, cfg: TrackingConfig, run_name: str, output_dir: str, config: dict):
        from mlflow import MlflowClient
        from mlflow.entities import Param

        uri = cfg.mlflow_uri or f"sqlite:///{os.path.abspath(output_dir)}/mlflow.db"
        self._client = MlflowClient(uri)
        id_file = os.path.join(output_dir, "mlflow_run_id")
        if os.path.isfile(id_file):
            self._run_id = open(id_file).read().strip()
            return
        experiment = self._client.get_experiment_by_name(cfg.project)
        artifacts = None if cfg.mlflow_uri else f"file://{os.path.abspath(output_dir)}/mlartifacts"
        experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(
            cfg.project, artifact_location=artifacts)
        self._run_id = self._client.create_run(experiment_id, run_name=run_name).info.run_id
        params = [Param(key, str(value)[:6000]) for key, value in flatten(config).items()]
        self._client.log_batch(self._run_id, params=params)
        with open(id_file, "w") as f:
            f.write(self._run_id)

    def log(self, step: int, metrics: Metrics) -> None:
        from mlflow.entities import Metric

        stamp = _now_ms()
        self._client.log_batch(self._run_id, metrics=[Metric(name, value, stamp, step)
                                                      for name, value in _without_none(metrics).items()])

    def log_samples(self, step: int, records: list[dict]) -> None:
        columns, data = sample_table(records)
        self._client.log_table(self._run_id, {name: [row[i] for row in data] for i, name in enumerate(columns)},
                               artifact_file=f"samples/step_{step:06d}.json")

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


class RayMetricsBackend:
    """Each metric as a Ray gauge `rlsys_<name>` (tag `run`), so the Ray dashboard's
    metrics view and Prometheus scrape them; `/` and other symbols become `_`."""

    def __init__(self, run_name: str):
        self._run_name = run_name
        self._gauges: dict = {}

    def log(self, step: int, metrics: Metrics) -> None:
        for name, value in _without_none({"step": step, **metrics}).items():
            self._gauge(name).set(value, tags={"run": self._run_name})

    def _gauge(self, name: str):
        if name not in self._gauges:
            from ray.util.metrics import Gauge

            self._gauges[name] = Gauge(ray_metric_name(name), description=f"rlsys {name}", tag_keys=("run",))
        return self._gauges[name]

    def close(self) -> None:
        pass


def ray_metric_name(name: str) -> str:
    return "rlsys_" + re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _markdown_cell(cell: Any) -> str:
    text = f"{cell:.4g}" if isinstance(cell, float) else str(cell)
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "\\n")


def _plain(value: Any) -> float | None:
    value = float(value) if hasattr(value, "__float__") else value
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _without_none(metrics: Metrics) -> Metrics:
    return {name: value for name, value in metrics.items() if value is not None}


def flatten(nested: dict, prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}"""
    flat = {}
    for key, value in nested.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _now_ms() -> int:
    return int(time.time() * 1000)


def _stable_id(output_dir: str) -> str:
    """A stable id per output directory, so a resumed run continues the same wandb run."""
    return hashlib.sha1(os.path.abspath(output_dir).encode()).hexdigest()[:16]
