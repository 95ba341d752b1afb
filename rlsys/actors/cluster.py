"""Connect to Ray: join RAY_ADDRESS when set, else start a local cluster."""

from __future__ import annotations

import os

import ray

from rlsys.config.loader import ConfigError
from rlsys.config.schema import RayConfig

# Run-time environment of every actor: no hub access, quiet tokenizers.
WORKER_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
              "OMP_WAIT_POLICY": "PASSIVE"}


def ensure_ray(cfg: RayConfig) -> None:
    if ray.is_initialized():
        return
    runtime_env = {"env_vars": WORKER_ENV}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env=runtime_env, log_to_driver=True)
    else:
        ray.init(
            num_cpus=os.cpu_count(),
            include_dashboard=cfg.include_dashboard,
            dashboard_host=cfg.dashboard_host,
            runtime_env=runtime_env,
        )


def check_resources(num_workers: int, cfg: RayConfig) -> None:
    """Fail fast, naming the key, when the cluster cannot place the group."""
    available = ray.cluster_resources()
    need_cpus = num_workers * cfg.cpus_per_worker
    if need_cpus > available.get("CPU", 0):
        raise ConfigError(
            f"ray.cpus_per_worker: {num_workers} workers x {cfg.cpus_per_worker} CPUs = {need_cpus} CPUs, "
            f"but the Ray cluster has {available.get('CPU', 0):g}"
        )
    need_gpus = num_workers * cfg.gpus_per_worker
    if need_gpus > available.get("GPU", 0):
        raise ConfigError(
            f"ray.gpus_per_worker: {num_workers} workers x {cfg.gpus_per_worker:g} GPUs = {need_gpus:g} GPUs, "
            f"but the Ray cluster has {available.get('GPU', 0):g}"
        )
