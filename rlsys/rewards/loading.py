"""Turn a reward term of the config into a callable, checked before Ray starts.

A term names a registered reward, a Python file, or a package directory
(imported by `rlsys.user_code`, which sends its modules to the reward actors by
value).
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from typing import Any

from rlsys.config.loader import ConfigError, first_line
from rlsys.config.rl import RewardTerm
from rlsys.rewards.registry import RewardFn, get_reward, registered_rewards
from rlsys.user_code import load_function, split_entry

FIELDS = ("data_source", "solution_str", "ground_truth", "extra_info")
BATCHED_FIELDS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")


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
    _check_kwargs(fn, term.kwargs, key)
    return RewardFunction(fn, keywords, term.batched, dict(term.kwargs), search_path)


def _check_kwargs(fn: RewardFn, kwargs: dict, key: str) -> None:
    """A reward may check its kwargs against the machine before the run (`fn.check_kwargs(kwargs)`,
    as `code_exec` checks its sandbox); what it raises is a config error naming the term."""
    check = getattr(fn, "check_kwargs", None)
    if check is None:
        return
    try:
        check(kwargs)
    except Exception as err:  # the reward's own refusal
        raise ConfigError(f"{key}.kwargs: {type(err).__name__}: {first_line(err)}") from None


def eval_term(spec: str) -> RewardTerm:
    """`eval.reward` as a reward term: a registered name, or `path[:function]` of a file or package."""
    if spec in registered_rewards() or not (spec.endswith(".py") or os.sep in spec or ":" in spec):
        return RewardTerm(name=spec)
    path, function = split_entry(spec, "compute_score")
    return RewardTerm(path=path, function=function)


def term_label(term: RewardTerm) -> str:
    return term.name or f"{os.path.splitext(os.path.basename(term.path.rstrip('/')))[0]}.{term.function}"


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
