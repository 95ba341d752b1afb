"""The GPUs a run uses when its config leaves them to the cluster (`config.loader.fill_gpu_defaults`):
a local cluster's are known when the config is read, a joined one's (RAY_ADDRESS) once connected to.
A job written on a laptop runs on a GPU node unchanged, and one that trains on CPU beside a
cluster's GPUs says so before it starts."""

from __future__ import annotations

import logging

from rlsys.actors.cluster import cluster_gpus
from rlsys.config.loader import fill_gpu_defaults
from rlsys.config.schema import EvalJobConfig, RLJobConfig, TrainJobConfig

log = logging.getLogger(__name__)


def fill_cluster_defaults(cfg: TrainJobConfig | RLJobConfig | EvalJobConfig) -> None:
    """The keys left empty, from the GPUs of the cluster the run will use; a line when it has GPUs
    and the training ranks take none."""
    gpus = cluster_gpus(cfg.ray)
    fill_gpu_defaults(cfg, gpus)
    if gpus and not cfg.ray.gpus_per_worker:
        log.warning("running on CPU, though the Ray cluster has %g GPUs: ray.gpus_per_worker is 0 (1 gives each "
                    "training rank a GPU of its own, with at most %g ranks)", gpus, gpus)
