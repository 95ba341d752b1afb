"""Places an 8-GPU node's actors the way an RL run does, on Ray's logical GPUs (no GPU needed), and
prints what each actor was given as JSON (tests/test_gpu_placement.py asserts it). Then the same
for the training ranks of two nodes of 4 GPUs each (`ray.cluster_utils`), and whether every node
sees the run's directory.

    python tests/assets/gpu_placement_probe.py SHARED_DIR

One node: 4 training ranks (1 GPU each) with two kinds of colocated engines, the rollout's (2
engines, tensor parallel 2: vLLM's Ray workers in the ranks' bundles) and a reward model's (4
engines, tp 1), so each GPU holds a rank and one engine rank of each kind (a third of it each);
a separate rollout engine of tp 2 in a bundle of its own; a rank whose Ray leaves
CUDA_VISIBLE_DEVICES alone. The two-node cluster's third node, with a filesystem of its own, fetches a
Hub id's snapshot itself (HF_ENDPOINT and HF_HOME from the test)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlsys.actors.cluster import assigned_gpu_index, gpu_shares, place_ranks
from rlsys.actors.engine_placement import place_engines
from rlsys.config.rollout import RolloutConfig, ServingConfig

WAIT_S = 60.0
"""Longer than any actor's start on a loaded 2-core machine; an actor Ray cannot place never starts."""
JOIN_S = 300.0
"""A node's start (`ray start`: its raylet and agents, each importing Ray) on a loaded 2-core machine,
all its attempts together."""
NODE_STARTS = 3


@ray.remote
class Probe:
    def seen(self) -> dict:
        gpus = [str(gpu) for gpu in ray.get_runtime_context().get_accelerator_ids()["GPU"]]
        return {"gpus": gpus, "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "index": assigned_gpu_index() if gpus else None}

    def start_workers_as_vllm(self) -> dict:
        """What vLLM's Ray executor does in an engine actor given VLLM_RAY_BUNDLE_INDICES: a worker
        per index, in the engine actor's placement group, with VLLM_RAY_PER_WORKER_GPUS each (kept, as
        the engine keeps its workers)."""
        from ray.util import get_current_placement_group

        from rlsys.rollout.vllm_engine import executor_backend

        group = get_current_placement_group()
        bundles = [int(b) for b in os.environ["VLLM_RAY_BUNDLE_INDICES"].split(",")]
        share = float(os.environ["VLLM_RAY_PER_WORKER_GPUS"])
        self.workers = workers = [Probe.options(num_cpus=0, num_gpus=share, scheduling_strategy=PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=bundle, placement_group_capture_child_tasks=True)).remote()
            for bundle in bundles]
        ready, _ = ray.wait([w.seen.remote() for w in workers], num_returns=len(workers), timeout=WAIT_S)
        return {"backend": executor_backend(len(bundles)), "in_group": group is not None,
                "workers": [ray.get(r)["gpus"] for r in ready] if len(ready) == len(workers) else None}

    def backend(self, tensor_parallel_size: int) -> str | None:
        from rlsys.rollout.vllm_engine import executor_backend

        return executor_backend(tensor_parallel_size)


def seen(actors: list) -> list[dict] | None:
    """Each actor's `seen()`, or None when any of them was never placed."""
    refs = [actor.seen.remote() for actor in actors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=WAIT_S)
    return ray.get(refs) if len(ready) == len(refs) else None


def seated(placement, index: int, **env):
    seat = placement.seat(index)
    return Probe.options(num_cpus=seat.num_cpus, num_gpus=seat.num_gpus, scheduling_strategy=seat.strategy,
                         runtime_env={"env_vars": {**seat.env, **env}}).remote()


def one_node() -> dict:
    ray.init(address="local", num_cpus=4, num_gpus=8, include_dashboard=False, log_to_driver=False)
    ranks = place_ranks(4, {"CPU": 0.5, "GPU": 1})
    rank_share, engine_share = gpu_shares(1, colocated_engines=2)
    rank_actors = [Probe.options(num_cpus=0.5, num_gpus=rank_share, scheduling_strategy=PlacementGroupSchedulingStrategy(
        ranks.group, placement_group_bundle_index=bundle)).remote() for bundle in ranks.bundles]
    rollout = place_engines(RolloutConfig(placement="colocated", num_engines=2, tensor_parallel_size=2), ranks, 2,
                            engine_share, "rollout engines", "rollout.cpus_per_engine")
    rollout_actors = [seated(rollout, i) for i in range(2)]
    reward = place_engines(ServingConfig(placement="colocated", num_engines=4), ranks, 2, engine_share,
                           "reward engines", "reward.terms[0].serving.cpus_per_engine")
    reward_actors = [seated(reward, i) for i in range(4)]
    separate = place_engines(RolloutConfig(placement="separate", num_engines=1, tensor_parallel_size=2,
                                           cpus_per_engine=1, gpus_per_engine=1), None, 2, 0.0,
                             "rollout engines", "rollout.cpus_per_engine")
    separate_actor = seated(separate, 0)
    result = {
        "rank_share": rank_share,
        "ranks": seen(rank_actors),
        "rollout_seats": [{"num_gpus": rollout.seat(i).num_gpus, "env": rollout.seat(i).env} for i in range(2)],
        "rollout": [ray.get(a.start_workers_as_vllm.remote(), timeout=2 * WAIT_S) for a in rollout_actors],
        "rollout_actors": seen(rollout_actors),
        "reward": seen(reward_actors),
        "separate": seen([separate_actor]),
        "separate_backend": ray.get(separate_actor.backend.remote(2)),
    }
    # every GPU of the ranks is now full: one more share of rank 0's never schedules (how the
    # engine actor's own share, beside its workers', hung a tensor-parallel engine)
    extra = Probe.options(num_cpus=0, num_gpus=engine_share, scheduling_strategy=PlacementGroupSchedulingStrategy(
        ranks.group, placement_group_bundle_index=ranks.bundles[0])).remote()
    result["one_share_more"] = bool(ray.wait([extra.seen.remote()], timeout=5)[0])
    noset = Probe.options(num_cpus=0, num_gpus=1, runtime_env={
        "env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}).remote()
    result["noset"] = seen([noset])
    ray.shutdown()
    return result


def two_nodes(shared_dir: str) -> dict:
    """Then a third node that sees another filesystem at `shared_dir` (a tmpfs mounted over it in a
    mount namespace of its own): the check that every node shares output_dir must name it."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 4})
    cluster.add_node(num_cpus=1, num_gpus=4)
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        ranks = place_ranks(8, {"CPU": 0.1, "GPU": 1})
        rollout = place_engines(RolloutConfig(placement="colocated", num_engines=4, tensor_parallel_size=2), ranks,
                                1, 0.5, "rollout engines", "rollout.cpus_per_engine")
        result = {"nodes": list(ranks.nodes), "bundles": list(ranks.bundles),
                  "engine_bundles": [rollout.seat(i).env["VLLM_RAY_BUNDLE_INDICES"] for i in range(4)],
                  "shared": refusal(shared_dir)}
        result["not_shared"] = with_node_of_another_filesystem(cluster.address, shared_dir)
        return result
    finally:
        ray.shutdown()
        cluster.shutdown()


def refusal(shared_dir: str) -> str:
    """check_nodes_share's line for `shared_dir` as output_dir and a model directory in it ("" if none)."""
    from rlsys.actors.cluster import check_nodes_share
    from rlsys.config.loader import ConfigError

    model = os.path.join(shared_dir, "model")
    os.makedirs(model, exist_ok=True)
    try:
        check_nodes_share(shared_dir, {"model.path": model})
    except ConfigError as err:
        return str(err)
    return ""


def hub_fetch() -> str:
    """check_nodes_share's line for a model named by its Hub id whose snapshot (HF_HOME, set by the test
    inside the directory the third node sees another filesystem at) that node lacks: it fetches its own
    ("" if none). output_dir is a directory every node sees."""
    from rlsys.actors.cluster import check_nodes_share
    from rlsys.config.loader import ConfigError
    from rlsys.models import hub

    output_dir = tempfile.mkdtemp()
    try:
        check_nodes_share(output_dir, {"model.path": hub.resolve("test-org/tiny", "model.path")})
    except ConfigError as err:
        return str(err)
    finally:
        shutil.rmtree(output_dir)
    return ""


def last_error(output) -> str:
    """The last line of a process's output that names an error, else its last line."""
    output.seek(0)
    lines = [line.strip() for line in output.read().splitlines() if line.strip()] or [""]
    errors = [line for line in lines if "Error" in line or "Exception" in line or "denied" in line]
    return (errors or lines)[-1][:300]


def with_node_of_another_filesystem(address: str, shared_dir: str) -> dict:
    """Start the node (again where `ray start` gave up: it waits a fixed 30 s for its raylet to
    register, which a loaded 2-core machine can miss), then ask for the refusal."""
    if not shutil.which("unshare"):
        return {"unavailable": "no unshare command"}
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    start = (f"mount -t tmpfs tmpfs {shared_dir} && exec {ray_cli} start --block --address={address} --num-cpus=1 "
             f"--disable-usage-stats")
    deadline = time.monotonic() + JOIN_S
    for _ in range(NODE_STARTS):
        output = tempfile.TemporaryFile("w+")
        node = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", start],
                                stdout=output, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            while sum(n["Alive"] for n in ray.nodes()) < 3 and node.poll() is None:
                if time.monotonic() > deadline:
                    return {"unavailable": f"the node did not join within {JOIN_S:g} s: {last_error(output)}"}
                time.sleep(0.5)
            if node.poll() is None:
                return {"refusal": refusal(shared_dir), "hub_fetch": hub_fetch()}
        finally:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGTERM)
            node.wait(timeout=60)
    # no mount namespaces here, or the node's start failed each time
    return {"unavailable": f"the node exited: {last_error(output)}"}


if __name__ == "__main__":
    json.dump({"one_node": one_node(), "two_nodes": two_nodes(sys.argv[1])}, sys.stdout)
