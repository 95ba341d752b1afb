"""The checks of an RL job's algorithm before Ray starts: names that resolve, options that fit the
parallel layout, the rest of the job (the rollout, asynchronous mode, segments) and each other; each
feature of the step checks its own rules (`rlsys.rl.features.check_features`). A failed check is a
ConfigError naming the key."""

from __future__ import annotations

from rlsys.config.layout import ParallelConfig
from rlsys.config.loader import ConfigError
from rlsys.config.rl import AlgorithmConfig
from rlsys.config.schema import RLJobConfig
from rlsys.rl.run_schedule import check_replay


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
    if correction.per_sequence and parallel.cp > 1:
        raise ConfigError("algorithm.rollout_correction: a sequence-level weight, rejection or veto needs each "
                          "sequence on one rank; not with parallel.cp > 1")


def check_algorithm_against_job(cfg: RLJobConfig) -> None:
    """Algorithm options that depend on the rest of the job: those reading the engine's log-probs
    need them over the full vocabulary (the trainer does not apply top-p), pass@k GRPO needs groups,
    asynchronous RL engines of their own, a schedule to follow an asynchronous run's, a context hook
    the tool loop."""
    algo = cfg.algorithm
    reads_engine_logprobs = (algo.rollout_correction.active or algo.old_logprobs == "rollout"
                             or algo.distill is not None)
    if cfg.rollout.top_p < 1 and reads_engine_logprobs:
        raise ConfigError("rollout.top_p: below 1 the engine's log-probs are renormalised over the nucleus, "
                          "which algorithm.rollout_correction, algorithm.distill and old_logprobs: rollout "
                          "cannot use")
    if algo.adv_estimator == "grpo_passk" and cfg.rollout.n < 2:
        raise ConfigError("algorithm.adv_estimator: grpo_passk compares a group's best two responses; "
                          "needs rollout.n >= 2")
    if cfg.train.async_mode != "off" and cfg.rollout.placement != "separate":
        raise ConfigError(f"train.async_mode: {cfg.train.async_mode} generates while the trainer updates, on "
                          "resources of the engines' own: set rollout.placement=separate")
    check_replay(cfg)
    if cfg.rollout.context_hook and cfg.rollout.agent_loop != "tool":
        raise ConfigError(f"rollout.context_hook: the tool loop runs a context hook, not {cfg.rollout.agent_loop}")
