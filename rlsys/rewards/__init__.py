from rlsys.rewards import builtin, code_exec  # noqa: F401  (registers the built-in rewards)
from rlsys.rewards.registry import get_reward, register_reward, registered_rewards, score_of

__all__ = ["get_reward", "register_reward", "registered_rewards", "score_of"]
