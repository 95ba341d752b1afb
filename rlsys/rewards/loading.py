"""Turn a reward term of the config into a callable."""

from __future__ import annotations

import functools
import importlib.util
import os
import sys

from ray import cloudpickle

from rlsys.config.loader import ConfigError
from rlsys.config.schema import RewardTerm
from rlsys.rewards.registry import RewardFn, get_reward, registered_rewards


def resolve_term(term: RewardTerm, key: str) -> RewardFn:
    """The term's function with its kwargs bound; config errors name `key`."""
    if term.path:
        fn = load_function(term.path, term.function, key)
    elif term.name in registered_rewards():
        fn = get_reward(term.name)
    else:
        raise ConfigError(f"{key}.name: unknown reward {term.name!r}; registered: "
                          f"{', '.join(registered_rewards())} (or give {key}.path)")
    return functools.partial(fn, **term.kwargs) if term.kwargs else fn


def term_label(term: RewardTerm) -> str:
    return term.name or f"{os.path.splitext(os.path.basename(term.path))[0]}.{term.function}"


def load_function(path: str, function: str, key: str) -> RewardFn:
    if not os.path.isfile(path):
        raise ConfigError(f"{key}.path: file not found: {path}")
    module_name = f"rlsys_user_reward_{abs(hash(os.path.abspath(path)))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # the user's file: report it, do not crash
        raise ConfigError(f"{key}.path: importing {path} failed: {type(err).__name__}: {err}") from None
    fn = getattr(module, function, None)
    if not callable(fn):
        raise ConfigError(f"{key}.function: {path} has no function {function!r}")
    # Ship the user's module by value: Ray workers cannot import it by name.
    cloudpickle.register_pickle_by_value(module)
    return fn
