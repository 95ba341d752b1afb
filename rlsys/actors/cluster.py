"""Connect to Ray (join RAY_ADDRESS when set, else start a local cluster),
check that a group fits, and name and retire the run's actors."""

from __future__ import annotations

import os
import signal
import threading
import time

import ray

from rlsys.config.loader import ConfigError
from rlsys.config.schema import RayConfig

# Run-time environment of every actor: no hub access, quiet tokenizers.
WORKER_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
              "OMP_WAIT_POLICY": "PASSIVE"}


def ensure_ray(cfg: RayConfig) -> None:
    """Join the cluster at RAY_ADDRESS (set by `ray job submit` too), or start a local one.

    A local cluster keeps Ray's defaults that matter for safety: token
    authentication stays on and the dashboard listens on `ray.dashboard_host`
    (127.0.0.1 unless configured)."""
    if ray.is_initialized():
        return
    runtime_env = {"env_vars": WORKER_ENV}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env=runtime_env, log_to_driver=True)
    else:
        ray.init(
            address="local",  # a cluster of our own even when `ray start` runs on this machine
            num_cpus=os.cpu_count(),
            include_dashboard=cfg.include_dashboard,
            dashboard_host=cfg.dashboard_host,
            runtime_env=runtime_env,
        )
    interrupt_on_sigterm()


def interrupt_on_sigterm() -> None:
    """Make SIGTERM (`kill`, `ray job stop`) raise KeyboardInterrupt in the driver, so the run
    unwinds: actors are shut down and the checkpoints written so far are kept. Ray's driver
    start-up installs a handler that aborts the process instead, hence this runs after it too."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_interrupt)


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def check_resources(num_workers: int, cpus: float, gpus: float, key: str) -> None:
    """Fail fast, naming the config key, when the cluster cannot place `num_workers`
    bundles of `cpus` CPUs and `gpus` GPUs (each bundle on a single node)."""
    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    for resource, per_worker in (("CPU", cpus), ("GPU", gpus)):
        total = sum(n.get(resource, 0) for n in nodes)
        largest = max((n.get(resource, 0) for n in nodes), default=0)
        if num_workers * per_worker > total:
            raise ConfigError(f"{key}: {num_workers} workers x {per_worker:g} {resource}s = "
                              f"{num_workers * per_worker:g} {resource}s, but the Ray cluster has {total:g}")
        if per_worker > largest:
            raise ConfigError(f"{key}: a worker needs {per_worker:g} {resource}s on one node, but the largest of "
                              f"the cluster's {len(nodes)} nodes has {largest:g}")


def wait_placed(placement, what: str, timeout_s: float = 120.0) -> None:
    """Wait for a placement group, with an error instead of a silent hang when the
    cluster's free resources (other jobs hold some) never allow it."""
    try:
        ray.get(placement.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise ConfigError(f"ray: could not place the {what} within {timeout_s:g} s; free resources: "
                          f"{ray.available_resources()}") from None


def actor_name(role: str, index: int) -> str:
    """Dashboard name of an rlsys actor: rlsys/train/0, rlsys/rollout/1, rlsys/reward/0 ..."""
    return f"rlsys/{role}/{index}"


def kill_named(actors: list, names: list[str], timeout_s: float = 30.0) -> None:
    """Kill actors and wait until their names are free, so the next group (the next
    pipeline stage, a replaced worker) can take the same names."""
    for actor in actors:
        ray.kill(actor)
    deadline = time.monotonic() + timeout_s
    for name in names:
        while time.monotonic() < deadline:
            try:
                ray.get_actor(name)
            except ValueError:
                break
            time.sleep(0.05)
