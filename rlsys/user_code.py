"""Importing a user's Python file or package by path: reward functions, advantage
estimators, policy losses, tools, agent loops and harnesses, named in config as
`path/to/file.py:name`.

A file's sibling modules (a user's `my_reward.py` doing `from gsm8k import
compute_score`) and a package's submodules are importable while it loads and are
registered with cloudpickle by value, so Ray actors receive them with the functions
instead of importing them by name. Each path is imported once.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from types import ModuleType

from ray import cloudpickle

from rlsys.config.loader import ConfigError

_loaded: dict[str, ModuleType] = {}


def import_user_code(path: str, key: str) -> ModuleType:
    """The module of a .py file or a package directory; errors name the config `key`."""
    path = os.path.abspath(path)
    if path in _loaded:
        return _loaded[path]
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "__init__.py")):
            raise ConfigError(f"{key}: {path} is a directory without __init__.py (not a Python package)")
    elif not os.path.isfile(path):
        raise ConfigError(f"{key}: file not found: {path}")
    search_path = os.path.dirname(path)
    before = set(sys.modules)
    sys.path.insert(0, search_path)
    try:
        module = _import(path)
    except Exception as err:  # the user's code: report it, do not crash
        raise ConfigError(f"{key}: importing {path} failed: {type(err).__name__}: {err}") from None
    finally:
        sys.path.remove(search_path)
    for name in set(sys.modules) - before:
        if _defined_under(sys.modules[name], search_path):
            cloudpickle.register_pickle_by_value(sys.modules[name])
    _loaded[path] = module
    return module


def load_function(path: str, function: str, key: str) -> tuple[Callable, str]:
    """`function` from a .py file or a package directory, and the directory to search for its imports;
    errors name `key`.path and `key`.function."""
    module = import_user_code(path, f"{key}.path")
    fn = getattr(module, function, None)
    if not callable(fn):
        raise ConfigError(f"{key}.function: {os.path.abspath(path)} has no function {function!r}")
    return fn, os.path.dirname(os.path.abspath(path))


def split_entry(spec: str, default: str = "") -> tuple[str, str]:
    """`path/to/file.py:name` as (path, name); `default` as the name when none is given."""
    path, colon, name = spec.rpartition(":")
    return (path, name or default) if colon else (spec, default)


def load_entry(spec: str, key: str, default: str = "") -> tuple[object | None, str, str]:
    """The object `name` of `path/to/file.py:name` (None when the module has none), its name, and
    the module's absolute path (for the caller's error); errors importing it name `key`."""
    path, name = split_entry(spec, default)
    return getattr(import_user_code(path, key), name, None), name, os.path.abspath(path)


def _import(path: str) -> ModuleType:
    """The file under a private name, or the package under its own (so its relative imports work)."""
    if os.path.isdir(path):
        return importlib.import_module(os.path.basename(path))
    name = f"rlsys_user_code_{abs(hash(path))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _defined_under(module, directory: str) -> bool:
    source = getattr(module, "__file__", None)
    return bool(source) and os.path.abspath(source).startswith(directory + os.sep)
