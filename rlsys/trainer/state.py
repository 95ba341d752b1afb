"""A rank's state on disk: the distributed checkpoint a run resumes from (model, optimizer,
schedule and RNG under HF names, so any layout can read it). It takes the model's parts, optimizers
and schedules, not the rank's model; the Hugging Face directory a stage exports is `hf_export`'s."""

from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from rlsys.config.model import ModelConfig
from rlsys.models import lora
from rlsys.trainer.schedule import follow_schedule


class RankState:
    def __init__(self, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer],
                 schedulers: list[torch.optim.lr_scheduler.LambdaLR], model_cfg: ModelConfig, peak_lr: float):
        """`peak_lr`: this run's `optim.lr`, which a restored schedule follows (`follow_schedule`)."""
        self.parts, self.optimizers, self.schedulers = parts, optimizers, schedulers
        self.model_cfg, self.peak_lr = model_cfg, peak_lr

    def save(self, path: str, rank: int) -> None:
        dcp.save(self._state(), checkpoint_id=os.path.join(path, "model_optim"))
        extra = {"schedulers": [s.state_dict() for s in self.schedulers], "rng": torch.get_rng_state()}
        torch.save(extra, os.path.join(path, f"rank{rank}.pt"))

    def load(self, path: str, rank: int) -> None:
        state = self._state()
        dcp.load(state, checkpoint_id=os.path.join(path, "model_optim"))
        flat = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)
        for part, optimizer in zip(self.parts, self.optimizers):
            set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
            set_optimizer_state_dict(part, optimizer, state["optim"], options=flat)
        extra = torch.load(os.path.join(path, f"rank{rank}.pt"), weights_only=False)
        for scheduler, scheduler_state in zip(self.schedulers, extra["schedulers"]):
            scheduler.load_state_dict(scheduler_state)
            follow_schedule(scheduler, self.peak_lr)
        torch.set_rng_state(extra["rng"])

    def _state(self) -> dict:
        """Model and optimizer state of every part, keyed by HF names (so any layout can read it)."""
        flat = StateDictOptions(flatten_optimizer_state_dict=True)
        model, optim = {}, {}
        for part in self.parts:
            model.update(get_model_state_dict(part))
        if self.model_cfg.lora.rank:  # the frozen base is the model on disk
            model = {name: tensor for name, tensor in model.items() if lora.is_adapter(name)}
        for part, optimizer in zip(self.parts, self.optimizers):
            optim.update(get_optimizer_state_dict(part, optimizer, options=flat))
        return {"model": model, "optim": optim}
