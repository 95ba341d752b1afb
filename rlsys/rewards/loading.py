"""Turn a reward term of the config into a callable, checked before Ray starts.

A term names a registered reward, a Python file, or a package directory. A
file's sibling modules (a user's `my_reward.py` doing `from gsm8k import
compute_score`) and a package's submodules are importable while it loads and
are registered with cloudpickle by value, so the reward actors receive them
with the function instead of importing them by name.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from ray import cloudpickle

from rlsys.config.loader import ConfigError
from rlsys.config.schema import RewardTerm
from rlsys.rewards.registry import RewardFn, get_reward, registered_rewards

FIELDS = ("data_source", "solution_str", "ground_truth", "extra_info")
BATCHED_FIELDS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")

_loaded: dict[str, Any] = {}
"""Modules already imported from a path, so checking a term and running it import it once."""


@dataclass(frozen=True)
class RewardFunction:
    """A reward callable and how the four fields reach it: by keyword when its
    parameters carry VeRL's names (as VeRL's reward managers call it; a function
    taking only some of them, e.g. `compute_score(solution_str, ground_truth)`,
    gets those), else positionally."""

    fn: RewardFn
    keywords: tuple[str, ...] | None
    """Field names passed by keyword, or None for the four positionally."""
    batched: bool = False
    kwargs: dict[str, Any] = field(default_factory=dict)
    search_path: str = ""
    """The directory the function was loaded from; reward actors add it to sys.path."""

    def __call__(self, fields: tuple) -> Any:
        if self.keywords is None:
            return self.fn(*fields, **self.kwargs)
        names = BATCHED_FIELDS if self.batched else FIELDS
        given = dict(zip(names, fields))
        return self.fn(**{name: given[name] for name in self.keywords}, **self.kwargs)


def resolve_term(term: RewardTerm, key: str) -> RewardFunction:
    """The term's function, bound to its kwargs and checked against the reward signature;
    config errors name `key`."""
    search_path = ""
    if term.path:
        fn, search_path = load_function(term.path, term.function, key)
    elif term.name in registered_rewards():
        fn = get_reward(term.name)
    else:
        raise ConfigError(f"{key}.name: unknown reward {term.name!r}; registered: "
                          f"{', '.join(registered_rewards())} (or give {key}.path)")
    keywords = _bind(fn, term.batched, term.kwargs, key)
    return RewardFunction(fn, keywords, term.batched, dict(term.kwargs), search_path)


def eval_term(spec: str) -> RewardTerm:
    """`eval.reward` as a reward term: a registered name, or `path[:function]` of a file or package."""
    if spec in registered_rewards() or not (spec.endswith(".py") or os.sep in spec or ":" in spec):
        return RewardTerm(name=spec)
    path, _, function = spec.partition(":")
    return RewardTerm(path=path, function=function or "compute_score")


def term_label(term: RewardTerm) -> str:
    return term.name or f"{os.path.splitext(os.path.basename(term.path.rstrip('/')))[0]}.{term.function}"


def load_function(path: str, function: str, key: str) -> tuple[RewardFn, str]:
    """`function` from a .py file or a package directory, and the directory to search for its imports."""
    path = os.path.abspath(path)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "__init__.py")):
            raise ConfigError(f"{key}.path: {path} is a directory without __init__.py (not a Python package)")
        search_path = os.path.dirname(path)
    elif os.path.isfile(path):
        search_path = os.path.dirname(path)
    else:
        raise ConfigError(f"{key}.path: file not found: {path}")
    module = _loaded.get(path) or _import(path, search_path, key)
    fn = getattr(module, function, None)
    if not callable(fn):
        raise ConfigError(f"{key}.function: {path} has no function {function!r}")
    return fn, search_path


def _import(path: str, search_path: str, key: str):
    """Import the file (under a private name) or the package (under its own name, so its
    relative imports work), with its directory on sys.path for its sibling imports."""
    before = set(sys.modules)
    sys.path.insert(0, search_path)
    try:
        if os.path.isdir(path):
            module = importlib.import_module(os.path.basename(path))
        else:
            name = f"rlsys_user_reward_{abs(hash(path))}"
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
    except Exception as err:  # the user's code: report it, do not crash
        raise ConfigError(f"{key}.path: importing {path} failed: {type(err).__name__}: {err}") from None
    finally:
        sys.path.remove(search_path)
    for name in set(sys.modules) - before:
        if _defined_under(sys.modules[name], search_path):
            cloudpickle.register_pickle_by_value(sys.modules[name])
    _loaded[path] = module
    return module


def _defined_under(module, directory: str) -> bool:
    source = getattr(module, "__file__", None)
    return bool(source) and os.path.abspath(source).startswith(directory + os.sep)


def _bind(fn: RewardFn, batched: bool, kwargs: dict, key: str) -> tuple[str, ...] | None:
    """The fields `fn` takes by keyword (None: positionally), or a ConfigError when it cannot
    be called with the reward fields and the term's kwargs."""
    names = BATCHED_FIELDS if batched else FIELDS
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C function: trust it
        return None
    params = signature.parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    keywords = tuple(n for n in names if n in params and params[n].kind is not inspect.Parameter.POSITIONAL_ONLY)
    if keywords:
        keywords = names if takes_any else keywords
        trial = lambda: signature.bind(**dict.fromkeys(keywords), **kwargs)  # noqa: E731
    else:
        trial = lambda: signature.bind(*[None] * len(names), **kwargs)  # noqa: E731
    try:
        trial()
    except TypeError as err:
        shown = ", ".join(names)
        raise ConfigError(f"{key}: {getattr(fn, '__name__', fn)}{signature} cannot be called with "
                          f"({shown}){' and ' + ', '.join(kwargs) if kwargs else ''}: {err}") from None
    return keywords or None
