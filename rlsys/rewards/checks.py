"""The reward section's checks before Ray starts: every term resolves, and so does the eval's
reward. They live apart from `loading` because a reward model's check reads its directory (torch,
transformers), which the reward actors that import `loading` never need."""

from __future__ import annotations

from rlsys.config.loader import ConfigError
from rlsys.config.rl import RewardTerm
from rlsys.rewards.loading import eval_term, resolve_term
from rlsys.rewards.model_terms import check_model_term
from rlsys.rewards.registry import registered_rewards


def check_terms(terms: list[RewardTerm], distilled: bool) -> None:
    """Every reward term resolves: a registered name, a user's file or a reward model or judge; none
    at all only when a teacher's distillation gives the rewards."""
    if not terms and not distilled:
        raise ConfigError(f"reward.terms: empty; name at least one reward (registered: "
                          f"{', '.join(registered_rewards())}), give a path or a model, or set algorithm.distill")
    for i, term in enumerate(terms):
        if term.model:
            check_model_term(term, f"reward.terms[{i}]")
        elif not term.name and not term.path:
            raise ConfigError(f"reward.terms[{i}]: give a registered name, a path or a model")
        else:
            resolve_term(term, f"reward.terms[{i}]")


def check_eval_reward(spec: str) -> None:
    """`eval.reward`: a registered reward, or a user's file[:function]."""
    if not spec:
        raise ConfigError(f"eval.reward: empty; name the reward that judges a response (registered: "
                          f"{', '.join(registered_rewards())}) or give path/to/file.py[:function]")
    term = eval_term(spec)
    if term.name and term.name not in registered_rewards():
        raise ConfigError(f"eval.reward: unknown reward {spec!r}; registered: "
                          f"{', '.join(registered_rewards())} (or give path/to/file.py[:function])")
    resolve_term(term, "eval.reward")
