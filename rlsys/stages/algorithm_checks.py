"""The checks of an RL job's algorithm before Ray starts: names that resolve, options that fit the
parallel layout, the rest of the job (rollout, asynchronous mode, routing replay, segments) and
each other. A failed check is a ConfigError naming the key."""

from __future__ import annotations

import os

from transformers import PretrainedConfig

from rlsys.config.layout import ParallelConfig
from rlsys.config.loader import ConfigError
from rlsys.config.rl import AlgorithmConfig
from rlsys.config.schema import RLJobConfig
from rlsys.models.moe import num_experts
from rlsys.rl.run_schedule import SCHEDULE_FILE, read_schedule
from rlsys.rl.token_baseline import TokenBaseline
from rlsys.stages.limits import R3_ON_CPU, not_built


def check_algorithm(algo: AlgorithmConfig, parallel: ParallelConfig) -> None:
    """Imports `algorithm.extensions`, then checks the estimator and loss names against the registries."""
    from rlsys.algorithms.advantages import ADVANTAGES
    from rlsys.algorithms.aggregation import aggregates_per_sequence
    from rlsys.algorithms.policy_loss import POLICY_LOSSES
    from rlsys.algorithms.rollout_correction import rejection_bounds
    from rlsys.user_code import import_user_code

    for i, path in enumerate(algo.extensions):
        import_user_code(path, f"algorithm.extensions[{i}]")
    for key, name, registry in (("adv_estimator", algo.adv_estimator, ADVANTAGES),
                                ("policy_loss", algo.policy_loss, POLICY_LOSSES)):
        if name not in registry:
            raise ConfigError(f"algorithm.{key}: unknown {registry.kind} {name!r}; registered: "
                              f"{', '.join(registry.names())} (or add one with algorithm.extensions)")
    if aggregates_per_sequence(algo.loss_agg) and parallel.cp > 1:
        raise ConfigError(f"algorithm.loss_agg: {algo.loss_agg} averages each sequence's tokens, which needs each "
                          "sequence on one rank; not with parallel.cp > 1 (token-mean or seq-mean-token-sum are)")
    if POLICY_LOSSES[algo.policy_loss].whole_sequences and parallel.cp > 1:
        raise ConfigError(f"algorithm.policy_loss: {algo.policy_loss} reads whole sequences (a sequence's ratio "
                          "or mean, the micro-batch's statistics), which needs each sequence on one rank; "
                          "not with parallel.cp > 1")
    correction = algo.rollout_correction
    try:
        rejection_bounds(correction)
    except ValueError as err:
        raise ConfigError(f"algorithm.rollout_correction.rollout_rs: {err}") from None
    if correction.rollout_is_batch_normalize and correction.rollout_is == "none":
        raise ConfigError("algorithm.rollout_correction.rollout_is_batch_normalize: normalises the importance "
                          "weights; set rollout_is: token or sequence")
    if correction.per_sequence and parallel.cp > 1:
        raise ConfigError("algorithm.rollout_correction: a sequence-level weight, rejection or veto needs each "
                          "sequence on one rank; not with parallel.cp > 1")
    if correction.bypass_mode:
        _check_bypass_mode(algo)
    elif correction.active and algo.old_logprobs == "rollout":
        raise ConfigError("algorithm.rollout_correction: with old_logprobs: rollout every ratio is 1; "
                          "use old_logprobs: auto or trainer (or bypass_mode: true)")


def _check_bypass_mode(algo: AlgorithmConfig) -> None:
    """Bypass mode takes the engine's log-probs as the old ones and its loss from loss_type."""
    if algo.policy_loss != "vanilla":
        raise ConfigError(f"algorithm.policy_loss: bypass mode picks its loss by rollout_correction.loss_type "
                          f"(ppo_clip or reinforce), not {algo.policy_loss}; leave policy_loss: vanilla")
    if algo.old_logprobs not in ("auto", "rollout"):
        raise ConfigError(f"algorithm.old_logprobs: bypass mode takes the engine's log-probs as the old ones, "
                          f"not {algo.old_logprobs}'s")
    if algo.rollout_correction.rollout_is_batch_normalize:
        raise ConfigError("algorithm.rollout_correction.rollout_is_batch_normalize: in bypass mode the weights "
                          "follow the policy being updated, so no mean over the batch precedes the update")


def check_router_replay(cfg: RLJobConfig, model_config: PretrainedConfig) -> None:
    """R2 replays an MoE model's routing from the trainer's old-log-prob pass, R3 the rollout engine's."""
    algo = cfg.algorithm
    if algo.router_replay == "none":
        return
    if not num_experts(model_config):
        raise ConfigError("algorithm.router_replay: the model has no MoE layers to replay")
    if algo.router_replay == "r2" and algo.old_logprobs == "rollout":
        raise ConfigError("algorithm.router_replay: r2 records the routing in the trainer's old-log-prob pass; "
                          "not with old_logprobs: rollout")
    if algo.router_replay == "r3" and not (cfg.ray.gpus_per_worker or cfg.rollout.gpus_per_engine):
        raise not_built(R3_ON_CPU, "algorithm.router_replay: r3 needs the rollout engines' routing, which vLLM "
                        "returns only on a GPU (its CPU model runner does not record it); on CPU use r2")
    if algo.router_replay == "r3" and cfg.rollout.agent_loop == "openai":
        raise ConfigError("algorithm.router_replay: r3 not with rollout.agent_loop: openai (a harness's calls "
                          "need not continue one sequence, so no engine call routes a whole trajectory); use r2")


def check_algorithm_against_job(cfg: RLJobConfig) -> None:
    """Algorithm options that depend on the rest of the job: those reading the engine's log-probs
    need them over the full vocabulary (the trainer does not apply top-p), DAPO's filter needs
    groups (as does pass@k GRPO), a critic warm-up needs a critic."""
    algo = cfg.algorithm
    reads_engine_logprobs = (algo.rollout_correction.active or algo.old_logprobs == "rollout"
                             or algo.distill is not None)
    if cfg.rollout.top_p < 1 and reads_engine_logprobs:
        raise ConfigError("rollout.top_p: below 1 the engine's log-probs are renormalised over the nucleus, "
                          "which algorithm.rollout_correction, algorithm.distill and old_logprobs: rollout "
                          "cannot use")
    if algo.filter_groups and cfg.rollout.n < 2:
        raise ConfigError("algorithm.filter_groups: needs groups of rollout.n >= 2 responses")
    if TokenBaseline.estimates(algo.adv_estimator) and (algo.old_logprobs in ("current", "rollout")
                                                        or algo.router_replay == "r2"
                                                        or algo.rollout_correction.bypass_mode):
        raise ConfigError(f"algorithm.adv_estimator: {algo.adv_estimator} reads the sums of squared probabilities "
                          "of the trainer's old-log-prob pass: needs old_logprobs: auto or trainer, without "
                          "router_replay: r2 or bypass_mode")
    if algo.adv_estimator == "remax" and cfg.train.async_mode != "off":
        raise ConfigError("algorithm.adv_estimator: remax generates its greedy baselines in the step; not with "
                          "train.async_mode")
    if algo.adv_estimator == "grpo_passk" and cfg.rollout.n < 2:
        raise ConfigError("algorithm.adv_estimator: grpo_passk compares a group's best two responses; "
                          "needs rollout.n >= 2")
    if cfg.critic.warmup_steps and algo.adv_estimator != "gae":
        raise ConfigError("critic.warmup_steps: there is no critic unless algorithm.adv_estimator is gae")
    if cfg.train.async_mode != "off":
        if cfg.rollout.placement != "separate":
            raise ConfigError(f"train.async_mode: {cfg.train.async_mode} generates while the trainer updates, on "
                              "resources of the engines' own: set rollout.placement=separate")
        if algo.filter_groups:
            raise ConfigError("algorithm.filter_groups: DAPO's dynamic sampling draws prompts a step at a time; "
                              "not with train.async_mode")
    if cfg.train.replay is not None:
        _check_replay(cfg)
    _check_segments(cfg)


def _check_segments(cfg: RLJobConfig) -> None:
    """A context hook needs the tool loop; a critic's returns are per row, not per episode, so
    gae trains episodes of one segment."""
    rollout = cfg.rollout
    if rollout.context_hook and rollout.agent_loop != "tool":
        raise ConfigError(f"rollout.context_hook: the tool loop runs a context hook, not {rollout.agent_loop}")
    segmented = rollout.agent_loop == "openai" or bool(rollout.context_hook)
    if segmented and rollout.train_segments == "all" and cfg.algorithm.adv_estimator == "gae":
        raise ConfigError("rollout.train_segments: gae's critic returns are per segment, not per episode; "
                          "set rollout.train_segments: last (or an outcome estimator such as grpo)")
    if rollout.context_hook and cfg.algorithm.router_replay == "r3":
        raise ConfigError("algorithm.router_replay: r3 not with rollout.context_hook (a rewritten history's "
                          "segment was routed by no single engine call); use r2")


def _check_replay(cfg: RLJobConfig) -> None:
    """A schedule to follow: an asynchronous run's, for as many engines."""
    if cfg.train.async_mode == "off":
        raise ConfigError("train.replay: a synchronous run repeats itself without a schedule; set train.async_mode")
    own = os.path.join(cfg.output_dir, SCHEDULE_FILE)
    if os.path.abspath(cfg.train.replay) in {os.path.abspath(cfg.output_dir), os.path.abspath(own)}:
        raise ConfigError(f"train.replay: {cfg.train.replay} is this run's own schedule, which it writes again; "
                          "give the recorded run's and another output_dir")
    try:
        lines = read_schedule(cfg.train.replay)
    except (OSError, ValueError) as err:
        raise ConfigError(f"train.replay: cannot read a schedule from {cfg.train.replay} ({err})") from None
    engines = {len(line.get("engines", [])) for line in lines}
    if engines - {cfg.rollout.num_engines}:
        raise ConfigError(f"train.replay: {cfg.train.replay} was recorded with {sorted(engines)} engines; this job "
                          f"has rollout.num_engines={cfg.rollout.num_engines}")
