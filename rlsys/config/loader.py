"""YAML + dotted overrides -> typed, checked config objects.

Every failure is a `ConfigError` naming the offending key; the CLI turns it
into one line on stderr and exit code 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from pathlib import Path
from typing import Any, TypeVar

import pydantic
import yaml

from rlsys.config import peer_names
from rlsys.config.rollout import CPU_ENGINE_MEMORY_GIB

if typing.TYPE_CHECKING:
    from rlsys.config.layout import RayConfig

T = TypeVar("T")


class ConfigError(ValueError):
    """A config problem, phrased as one line that names the key."""


def first_line(err: Exception) -> str:
    """The first line of an exception's message (its type when it has none), for one-line errors."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def load_config(schema: type[T], path: str | None, overrides: list[str] = (), gpus: float | None = None) -> T:
    raw = _read_yaml(path) if path else {}
    for item in overrides:
        key, value = _parse_override(item)
        _set_dotted(raw, key, value)
    return build_config(schema, raw, gpus)


def build_config(schema: type[T], raw: dict, gpus: float | None = None) -> T:
    """`gpus`: the cluster's GPUs, which size the keys left to them (`fill_gpu_defaults`); None: the local
    cluster's, or, when joining RAY_ADDRESS, left for preflight to fill once connected."""
    try:
        cfg = pydantic.TypeAdapter(schema).validate_python(raw)
    except pydantic.ValidationError as err:
        raise ConfigError(_describe(schema, err.errors()[0])) from None
    ray_cfg = getattr(cfg, "ray", None)
    if ray_cfg is not None and ray_cfg.cpus_per_worker is None:
        ray_cfg.cpus_per_worker = default_cpus_per_worker(cfg)
    if ray_cfg is not None and gpus is None and not os.environ.get("RAY_ADDRESS"):
        gpus = local_cluster_resources(ray_cfg)["GPU"]
    if ray_cfg is not None and gpus is not None:
        fill_gpu_defaults(cfg, gpus)
    return cfg


def default_cpus_per_worker(cfg: Any) -> int:
    """A local cluster's share of this machine's cores per training rank: the cores this process
    may run on (at most ray.num_cpus, which may exceed them), less separate rollout engines'
    CPUs, over the world size: one rank with all the cores trains a small model faster than
    ranks of one thread each (docs/performance.md). A cluster joined through RAY_ADDRESS is
    not known before it is joined: 1."""
    if os.environ.get("RAY_ADDRESS"):
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    cores = min(cores, cfg.ray.num_cpus or cores)
    rollout = getattr(cfg, "rollout", None)
    if rollout is not None and rollout.placement == "separate":
        cores -= int((rollout.num_engines or 1) * rollout.cpus_per_engine)
    parallel = getattr(cfg, "parallel", None)
    world_size = parallel.world_size if parallel is not None else 1
    return max(1, cores // world_size)


def fill_gpu_defaults(cfg: Any, gpus: float) -> None:
    """`ray.gpus_per_worker`, each engine group's `gpus_per_engine`, `rollout.num_engines` and
    `rollout.engine_memory_gib` where the config left them empty, for a cluster of `gpus` GPUs: a GPU for
    each training rank when there is one for every rank, and for each rank of a separate engine when the
    cluster has GPUs (preflight checks that both fit); colocated on the ranks' GPUs, an engine per
    `rollout.tensor_parallel_size` of them (every GPU generates); else CPU training and one engine. An
    engine on CPU gets a KV cache of CPU_ENGINE_MEMORY_GIB; one on a GPU keeps it empty, sized by its
    share of the device (`rollout.gpu_memory_utilization`)."""
    parallel = getattr(cfg, "parallel", None)
    ranks = parallel.world_size if parallel is not None else 1
    if cfg.ray.gpus_per_worker is None:
        cfg.ray.gpus_per_worker = 1.0 if gpus >= ranks else 0.0
    for _, engines in cfg.engine_groups() if hasattr(cfg, "engine_groups") else ():
        if engines.gpus_per_engine is None:  # engines of their own generate on GPUs of their own
            engines.gpus_per_engine = 1.0 if gpus else 0.0
    rollout = getattr(cfg, "rollout", None)
    if rollout is None:
        return
    on_gpu = cfg.ray.gpus_per_worker if rollout.placement == "colocated" else rollout.gpus_per_engine
    if rollout.num_engines is None:
        colocated_on_gpus = rollout.placement == "colocated" and on_gpu
        rollout.num_engines = max(1, ranks // rollout.tensor_parallel_size) if colocated_on_gpus else 1
    if rollout.engine_memory_gib is None and not on_gpu:
        rollout.engine_memory_gib = CPU_ENGINE_MEMORY_GIB


def local_cluster_resources(cfg: RayConfig) -> dict[str, float]:
    """The CPUs and GPUs of the local cluster `ensure_ray` would start: Ray's
    RAY_OVERRIDE_RESOURCES over `ray.num_cpus` / `ray.num_gpus` over this machine's cores and the
    GPUs CUDA sees."""
    import json

    import torch

    resources = {"CPU": float(cfg.num_cpus or os.cpu_count() or 1),
                 "GPU": float(cfg.num_gpus if cfg.num_gpus is not None else torch.cuda.device_count())}
    override = json.loads(os.environ.get("RAY_OVERRIDE_RESOURCES") or "{}")
    return {name: float(override.get(name, count)) for name, count in resources.items()}


def config_to_dict(cfg: Any) -> dict:
    return pydantic.TypeAdapter(type(cfg)).dump_python(cfg, mode="json")


def _read_yaml(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"--config: file not found: {path}")
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"--config: {path} is not valid YAML{where}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config: {path} must hold a mapping of keys at the top level")
    return data


def _parse_override(item: str) -> tuple[str, Any]:
    key, sep, text = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r}: expected dotted.key=value")
    try:
        return key, yaml.safe_load(text) if text else ""
    except yaml.YAMLError:
        return key, text


def _set_dotted(raw: dict, key: str, value: Any) -> None:
    node = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(parts[: i + 1])}: is a value, cannot set {key}")
        node = child
    node[parts[-1]] = value


def _describe(schema: type, error: dict) -> str:
    loc = [str(part) for part in error["loc"]]
    key = ".".join(loc) or "<root>"
    if error["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
        rl_job = "rollout" in _field_names(schema, [])
        for typed in _typed_keys(key, error.get("input")):
            if said := peer_names.answer(typed, rl_job):
                return f"{typed}: {said}"
        known = _field_names(schema, loc[:-1])
        close = difflib.get_close_matches(loc[-1], known, n=1)
        hint = f"; did you mean '{'.'.join(loc[:-1] + close)}'?" if close else ""
        return f"{key}: unknown config key{hint}"
    given = error.get("input")
    if error["type"] == "value_error" and not isinstance(given, (str, int, float)):
        # a section's own check (`__post_init__`) raises "field: why"
        return f"{key}.{error['msg'].removeprefix('Value error, ')}"
    shown = "" if isinstance(given, dict) else f" (got {given!r})"
    return f"{key}: {error['msg']}{shown}"


def _typed_keys(key: str, value: Any) -> list[str]:
    """The dotted keys as typed under an unknown `key` (the YAML below it flattened)."""
    if not isinstance(value, dict) or not value:
        return [key]
    return [typed for name, child in value.items() for typed in _typed_keys(f"{key}.{name}", child)]


def _field_names(schema: type, path: list[str]) -> list[str]:
    node = schema
    for part in path:
        if part.isdigit():
            continue
        hints = typing.get_type_hints(node)
        node = _dataclass_in(hints.get(part))
        if node is None:
            return []
    return [f.name for f in dataclasses.fields(node)]


def _dataclass_in(annotation: Any) -> type | None:
    if dataclasses.is_dataclass(annotation):
        return annotation
    for arg in typing.get_args(annotation):
        found = _dataclass_in(arg)
        if found is not None:
            return found
    return None
