"""Per-step metrics to every configured backend under the same names.

metrics.jsonl always gets one JSON object per step, with `step`; console,
wandb, tensorboard, mlflow and Ray's metrics (for the dashboard and
Prometheus) are chosen in `tracking.backends`.
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

    def close(self) -> None:
        for backend in self.backends:
            backend.close()


class JsonlBackend:
    """metrics.jsonl; a resumed run first drops the rows past the step it resumes from, so
    the file holds one row per step of the run as it went on (a restart's redone steps once)."""

    def __init__(self, output_dir: str, start_step: int):
        path = os.path.join(output_dir, "metrics.jsonl")
        kept = []
        if start_step and os.path.isfile(path):
            with open(path) as f:
                kept = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= start_step]
        with open(path, "w") as f:
            f.writelines(kept)
        self._file = open(path, "a")

    def log(self, step: int, metrics: Metrics) -> None:
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


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

    def close(self) -> None:
        self._writer.close()


class MlflowBackend:
    """A run in `tracking.mlflow_uri` (default: a SQLite store at output_dir/mlflow.db);
    a resumed run continues the same mlflow run."""

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
        experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(cfg.project)
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
