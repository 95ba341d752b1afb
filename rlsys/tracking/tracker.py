"""Per-step metrics to every configured backend under the same names.

metrics.jsonl always gets one JSON object per step, with `step`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any

from tqdm import tqdm

from rlsys.config.schema import TrackingConfig


class Tracker:
    def __init__(self, cfg: TrackingConfig, output_dir: str, config: dict, total_steps: int, start_step: int = 0,
                 log_every: int = 1):
        self.log_every = log_every
        run_name = cfg.run_name or os.path.basename(os.path.abspath(output_dir))
        self._jsonl = open(os.path.join(output_dir, "metrics.jsonl"), "a")
        self._bar = None
        if "console" in cfg.backends:
            self._bar = tqdm(total=total_steps, initial=start_step, desc=run_name, dynamic_ncols=True)
        self._wandb = self._tensorboard = None
        if "wandb" in cfg.backends:
            import wandb

            self._wandb = wandb.init(project=cfg.project, name=run_name, dir=output_dir, mode=cfg.wandb_mode,
                                     config=config, resume="allow", id=_wandb_id(output_dir))
        if "tensorboard" in cfg.backends:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(os.path.join(output_dir, "tensorboard"))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if self._tensorboard is not None:
            for name, value in metrics.items():
                self._tensorboard.add_scalar(name, value, step)
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            if step % self.log_every == 0:
                self._bar.set_postfix({k: f"{v:.4g}" for k, v in metrics.items() if k in _BAR_KEYS})

    def close(self) -> None:
        self._jsonl.close()
        if self._bar is not None:
            self._bar.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._tensorboard is not None:
            self._tensorboard.close()


_BAR_KEYS = ("loss", "grad_norm", "lr", "tokens_per_s", "reward/mean", "accuracy")


def _plain(value: Any) -> Any:
    value = float(value) if hasattr(value, "__float__") else value
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _wandb_id(output_dir: str) -> str:
    """A stable id per output directory, so a resumed run continues the same wandb run."""
    return hashlib.sha1(os.path.abspath(output_dir).encode()).hexdigest()[:16]
