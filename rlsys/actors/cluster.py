"""Connect to Ray (join RAY_ADDRESS when set, else start a local cluster), check that a group
fits, place the training ranks node by node, and create, name and retire the run's actors."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group

from rlsys.config.layout import RayConfig
from rlsys.config.loader import ConfigError, local_cluster_resources
from rlsys.console import LOG_FILE_ENV, StartupClock, record_startup, verbose
from rlsys.models import hub

log = logging.getLogger(__name__)

# Run-time environment of every actor: no hub access, quiet tokenizers.
WORKER_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
# Every actor keeps OpenMP's default wait policy (a spin, then sleep): PASSIVE would turn the
# spin between a multi-threaded rank's many small kernels into sleeps and wake-ups.

_log_dir = ""
_actor_names: dict[str, str] = {}
"""Actor id (hex) -> dashboard name, so a failure anywhere can name the actor that died."""


def ensure_ray(cfg: RayConfig) -> None:
    """Join the cluster at RAY_ADDRESS (set by `ray job submit` too), or start a local one.

    A local cluster keeps Ray's defaults that matter for safety: token
    authentication stays on and the dashboard listens on `ray.dashboard_host`
    (127.0.0.1 unless configured). Ray's own messages and the actors' output
    stay off the console unless the run is verbose."""
    if ray.is_initialized():
        return
    startup = StartupClock()
    quiet = {} if verbose() else {"log_to_driver": False, "logging_level": logging.ERROR}
    runtime_env = {"env_vars": WORKER_ENV}
    if os.environ.get("RAY_ADDRESS"):
        context = ray.init(address=os.environ["RAY_ADDRESS"], runtime_env=runtime_env, **quiet)
        where = f"connected to the Ray cluster at {os.environ['RAY_ADDRESS']}"
    else:
        context = ray.init(
            address="local",  # a cluster of our own even when `ray start` runs on this machine
            num_cpus=cfg.num_cpus or os.cpu_count(),
            **({"num_gpus": cfg.num_gpus} if cfg.num_gpus is not None else {}),
            include_dashboard=cfg.include_dashboard,
            dashboard_host=cfg.dashboard_host,
            runtime_env=runtime_env,
            **quiet,
        )
        where = f"started a local Ray cluster in {record_startup('ray_cluster', startup)['init_s']:.1f} s"
    dashboard = f"; dashboard http://{context.dashboard_url}" if context.dashboard_url else ""
    log.info("%s%s", where, dashboard)
    if quiet:
        _route_ray_errors_to_log()
    interrupt_on_sigterm()


def _route_ray_errors_to_log() -> None:
    """Ray's driver prints notices such as a worker's death straight to stderr, whatever
    `log_to_driver` says. In a quiet run they go to driver.log instead: the failure itself
    reaches the console as rlsys's one line."""
    import ray._private.worker as ray_worker

    def to_log(data: dict, ignore_prefix: bool) -> None:
        for line in data.get("lines", []):
            logging.getLogger("ray.errors").warning(line)

    ray_worker.print_to_stdstream = to_log


def interrupt_on_sigterm() -> None:
    """Make SIGTERM (`kill`, `ray job stop`) raise KeyboardInterrupt in the driver, so the run
    unwinds: actors are shut down and the checkpoints written so far are kept. Ray's driver
    start-up installs a handler that aborts the process instead, hence this runs after it too."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_interrupt)


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def gpu_shares(gpus_per_worker: float, colocated_engines: int) -> tuple[float, float]:
    """GPUs a training rank's actor and each engine rank colocated with it take of the rank's bundle,
    given the kinds of colocated engines (the rollout's, a frozen model's): a GPU holds one engine
    rank of each kind (`engine_placement.check_colocated_engines`), and they split it (Ray fractional
    GPUs), so that all see the GPU and the rollout engine can read the rank's shards through CUDA
    IPC. Separate engines take none of it."""
    share = gpus_per_worker / (1 + colocated_engines)
    return share, share if colocated_engines else 0.0


def check_resources(num_workers: int, cpus: float, gpus: float, key: str, local: RayConfig | None = None) -> None:
    """Fail fast, naming the config key and the remedy, when the cluster cannot place
    `num_workers` bundles of `cpus` CPUs and `gpus` GPUs (each bundle on a single node).
    `key` names the CPUs' setting (`ray.cpus_per_worker`, `rollout.cpus_per_engine`); a shortage of
    GPUs names its GPU twin. Before Ray starts a local cluster, the cluster is this machine as
    `local` (its `num_cpus`, `num_gpus`) would start it."""
    for resource, per_worker in (("CPU", cpus), ("GPU", gpus)):
        setting = key if resource == "CPU" else key.replace("cpus_per_", "gpus_per_")
        nodes = _node_resources(resource, local)
        total, largest = sum(nodes), max(nodes, default=0)
        needed = num_workers * per_worker
        if needed > total:
            workers = f"{num_workers} worker{'s' if num_workers != 1 else ''}"
            raise ConfigError(f"{setting}: {workers} x {per_worker:g} {resource}s = {needed:g} {resource}s, but the "
                              f"Ray cluster has {total:g}; {_remedy(resource, setting, needed)}")
        if per_worker > largest:
            raise ConfigError(f"{setting}: a worker needs {per_worker:g} {resource}s on one node, but the largest of "
                              f"the cluster's {len(nodes)} nodes has {largest:g}; lower {setting}")


def _remedy(resource: str, key: str, needed: float) -> str:
    """What makes a group that does not fit the cluster fit."""
    fewer = "the parallel degrees" if key.startswith("ray.") else "rollout.num_engines"
    if resource == "GPU":
        return f"lower {key} or {fewer}" + ("" if _joins_a_cluster() else
                                            ", or set ray.num_gpus if this machine has GPUs CUDA does not see")
    if _joins_a_cluster():
        return f"add nodes to the cluster, lower {key} or {fewer}"
    return (f"set ray.num_cpus={needed:g} to run them on this machine's cores, sharing them (slowly), "
            f"or lower {key} or {fewer}")


def _joins_a_cluster() -> bool:
    return bool(os.environ.get("RAY_ADDRESS")) or (ray.is_initialized() and len(ray.nodes()) > 1)


def cluster_gpus(local: RayConfig) -> float:
    """The GPUs of the cluster the run will use: a joined one's (RAY_ADDRESS, connected to here), else
    those of the local cluster `ensure_ray` would start."""
    if os.environ.get("RAY_ADDRESS"):
        ensure_ray(local)
    return sum(_node_resources("GPU", local))


def largest_node_cpus() -> float:
    """The most CPUs one node of the cluster has: all that a single engine can take."""
    return max(_node_resources("CPU", None), default=0)


def _node_resources(resource: str, local: RayConfig | None) -> list[float]:
    if ray.is_initialized():
        return [n["Resources"].get(resource, 0) for n in ray.nodes() if n["Alive"]]
    if os.environ.get("RAY_ADDRESS"):
        return [float("inf")]  # an existing cluster: checked once connected
    return [local_cluster_resources(local or RayConfig())[resource]]


def wait_placed(placement, what: str, timeout_s: float = 120.0) -> None:
    """Wait for a placement group, with an error instead of a silent hang when the
    cluster's free resources (other jobs hold some) never allow it."""
    try:
        ray.get(placement.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise ConfigError(f"ray: could not place the {what} within {timeout_s:g} s; free resources: "
                          f"{ray.available_resources()}") from None


@dataclass(frozen=True)
class RankPlacement:
    """The training ranks' placement group and the bundle each rank sits in, in rank order: a node's
    ranks are contiguous (`ranks_by_node`)."""

    group: PlacementGroup
    bundles: tuple[int, ...]
    nodes: tuple[str, ...] = ()
    """The node of each rank's bundle, in rank order."""

    def release(self) -> None:
        remove_placement_group(self.group)


def ranks_by_node(bundle_nodes: list[str]) -> list[int]:
    """Bundle indices in rank order, given each bundle's node: node by node (in the order of each
    node's first bundle), so that the ranks of a node are contiguous, as tensor-parallel groups and a
    colocated engine's GPUs on one node need; bundle order within a node."""
    nodes = list(dict.fromkeys(bundle_nodes))
    return sorted(range(len(bundle_nodes)), key=lambda bundle: (nodes.index(bundle_nodes[bundle]), bundle))


def place_ranks(world_size: int, bundle: dict[str, float]) -> RankPlacement:
    """A bundle per rank, packed onto as few nodes as fit, ranks numbered node by node."""
    group = placement_group([bundle] * world_size, strategy="PACK")
    wait_placed(group, f"training group ({world_size} x {bundle})")
    bundle_nodes = placement_group_table(group)["bundles_to_node_id"]
    nodes = [bundle_nodes[index] for index in range(world_size)]
    bundles = ranks_by_node(nodes)
    return RankPlacement(group, tuple(bundles), tuple(nodes[index] for index in bundles))


def assigned_gpu_index() -> int:
    """The CUDA index of the GPU Ray assigned this actor: its place in CUDA_VISIBLE_DEVICES, which
    Ray narrows to the actor's GPUs (index 0), or its id where Ray leaves the variable alone
    (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES: every GPU visible)."""
    gpu = str(ray.get_runtime_context().get_accelerator_ids()["GPU"][0])
    visible = [device.strip() for device in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    return visible.index(gpu) if gpu in visible else int(gpu)


def check_nodes_share(output_dir: str, paths: dict[str, str], timeout_s: float = 120.0) -> None:
    """On a cluster of several nodes, ask each node (a task pinned to it) whether it sees `output_dir`
    as this one does (a file written here is read there: ranks write checkpoint shards and the
    export there, the driver renames and prunes) and every local path of `paths` (config key ->
    path); a model named by its Hub id is fetched there first (`rlsys.models.hub`: its snapshot
    must come to the same path). Refuse in one line naming the first node that does not."""
    nodes = [node for node in ray.nodes() if node["Alive"]]
    if len(nodes) < 2:
        return
    import secrets

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    hub_names = {key: hub.RESOLVED[path] for key, path in paths.items() if path in hub.RESOLVED}
    runtime_env = {"env_vars": hub.fetch_env()} if hub_names else None
    token = secrets.token_hex(16)
    probe = os.path.join(output_dir, f".rlsys-node-check-{token[:8]}")
    with open(probe, "w") as f:
        f.write(token)
    try:
        checks = [(node, _node_sees.options(num_cpus=0, runtime_env=runtime_env,
                                            scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"],
                                                                                               soft=False))
                   .remote(probe, token, paths, hub_names)) for node in nodes]
        for node, check in checks:
            unseen = ray.get(check, timeout=timeout_s)
            if unseen:
                key, why = unseen
                raise ConfigError(f"{key}: node {node['NodeManagerAddress']} ({node['NodeID'][:8]}) {why}")
    finally:
        os.remove(probe)


@ray.remote
def _node_sees(probe: str, token: str, paths: dict[str, str], hub_names: dict[str, str]) -> tuple[str, str] | None:
    """(key, what this node lacks) of the first thing this node does not see, or None."""
    shared = ("as this machine does; every node must share output_dir and the local model paths (a shared "
              "filesystem: NFS, Lustre, a cloud file store)")
    try:
        with open(probe) as f:
            if f.read() != token:
                return "output_dir", f"does not see {os.path.dirname(probe)} {shared}"
    except OSError:
        return "output_dir", f"does not see {os.path.dirname(probe)} {shared}"
    for key, path in paths.items():
        if os.path.exists(path):
            continue
        if key not in hub_names:
            return key, f"does not see {path} {shared}"
        try:
            fetched = hub.resolve(hub_names[key], key)
        except ConfigError as err:
            return key, f"cannot fetch it: {err}"
        if fetched != path:
            return key, f"keeps {hub_names[key]} at {fetched}, not {path} (set one HF_HOME for every node)"
    return None


# -- named actors --------------------------------------------------------------


def set_log_dir(path: str) -> None:
    """Where the actors created from now on write their output (output_dir/logs)."""
    global _log_dir
    _log_dir = path


def actor_name(role: str, index: int) -> str:
    """Dashboard name of an rlsys actor: rlsys/train/0, rlsys/rollout/1, rlsys/reward/0 ..."""
    return f"rlsys/{role}/{index}"


def spawn(actor_cls, role: str, index: int, *args, timeout_s: float = 30.0, env: dict[str, str] | None = None,
          **options):
    """Create the actor rlsys/<role>/<index> from a `ray.remote` class, with `env` added to its
    environment. Its output goes to <log dir>/<role>-<index>.log (see `rlsys.console`); a name
    still held by an actor being killed is waited for rather than refused."""
    name = actor_name(role, index)
    env = dict(env or {})
    if _log_dir and not verbose():
        env[LOG_FILE_ENV] = os.path.join(_log_dir, f"{role}-{index}.log")
    if env:
        options["runtime_env"] = {"env_vars": env}
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            actor = actor_cls.options(name=name, **options).remote(*args)
            break
        except (ray.exceptions.ActorAlreadyExistsError, ValueError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    _actor_names[actor._actor_id.hex()] = name
    return actor


def log_file_of(name: str) -> str | None:
    """The log file of the actor rlsys/<role>/<index> (None when actors log to the console)."""
    parts = name.split("/")
    if not _log_dir or verbose() or len(parts) != 3:
        return None
    return os.path.join(_log_dir, f"{parts[1]}-{parts[2]}.log")


def name_of(actor_id: str | None) -> str | None:
    return _actor_names.get(actor_id or "")


def shut_down(actors: list, names: list[str], timeout_s: float = 10.0) -> None:
    """Let the actors that still answer release what outlives a killed process (a rank's
    process group, vLLM's shared-memory queues in /dev/shm), then kill them all."""
    if actors:
        ray.wait([actor.shutdown.remote() for actor in actors], num_returns=len(actors), timeout=timeout_s)
    kill_named(actors, names)


def kill_named(actors: list, names: list[str], timeout_s: float = 30.0) -> None:
    """Kill actors (dead ones too) and wait until their names are free, so the next group
    (the next pipeline stage, a restart, a replaced worker) can take the same names."""
    for actor in actors:
        try:
            ray.kill(actor)
        except ValueError:
            pass
    deadline = time.monotonic() + timeout_s
    for name in names:
        while time.monotonic() < deadline:
            try:
                ray.get_actor(name)
            except ValueError:
                break
            time.sleep(0.05)


def check_training_resources(ray_cfg: RayConfig, world_size: int) -> None:
    """The training ranks fit the cluster, each driving one GPU or none."""
    if ray_cfg.gpus_per_worker not in (0, 1):
        raise ConfigError(f"ray.gpus_per_worker: {ray_cfg.gpus_per_worker:g}; a training rank drives one GPU "
                          f"(1; 0 trains on CPU): two ranks on one GPU are refused by NCCL, and engines share a "
                          f"rank's GPU by rollout.placement: colocated")
    check_resources(world_size, ray_cfg.cpus_per_worker, ray_cfg.gpus_per_worker, "ray.cpus_per_worker", ray_cfg)
