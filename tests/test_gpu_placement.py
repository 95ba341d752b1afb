"""A GPU node's placement, seen on CPU: Ray schedules the logical GPUs it is told of, so which
actor gets which GPU, and whether it is placed at all, is what a GPU node would do. The
placement runs in a process of its own (tests/assets/gpu_placement_probe.py: its own Ray
clusters, one node of 8 GPUs and two of 4); what needs CUDA itself waits for a GPU
(scripts/gpu_check.sh)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import yaml
from cli_runs import run_commands
from test_rlvr import rl_raw

from rlsys.actors.cluster import RankPlacement, ranks_by_node
from rlsys.actors.engine_placement import _check_one_node_each, check_colocated_engines
from rlsys.config.layout import RayConfig
from rlsys.config.loader import ConfigError, load_config, local_cluster_resources
from rlsys.config.rollout import RolloutConfig
from rlsys.config.schema import RLJobConfig
from rlsys.rollout import vllm_engine
from rlsys.run import main

# One xdist worker runs this module (scripts/test.sh): the probe's clusters start once.
pytestmark = pytest.mark.xdist_group("gpu_placement")

PROBE = pathlib.Path(__file__).parent / "assets" / "gpu_placement_probe.py"


@pytest.fixture(scope="module")
def placed(tmp_path_factory, hub) -> dict:
    shared = tmp_path_factory.mktemp("shared")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and not k.startswith("HF_")}
    env |= {"HF_ENDPOINT": hub[1], "HF_HOME": str(shared / "hf"), "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "HF_HUB_ETAG_TIMEOUT": "120", "HF_HUB_DOWNLOAD_TIMEOUT": "120"}  # a loaded machine's server answers late
    result = subprocess.run([sys.executable, str(PROBE), str(shared)], capture_output=True, text=True, timeout=600,
                            env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_each_rank_and_colocated_engine_rank_takes_the_gpu_intended(placed):
    """Rank r has the GPU of its bundle; rollout engine e (tp 2) has its workers on the GPUs of ranks
    2e and 2e+1 and holds none itself; reward engine i (tp 1) shares rank i's GPU; all of them placed."""
    node = placed["one_node"]
    rank_gpus = [rank["gpus"] for rank in node["ranks"]]
    assert all(len(gpus) == 1 for gpus in rank_gpus) and len({g[0] for g in rank_gpus}) == 4
    assert [rank["index"] for rank in node["ranks"]] == [0, 0, 0, 0]  # Ray narrowed CUDA_VISIBLE_DEVICES
    assert [engine["gpus"] for engine in node["rollout_actors"]] == [[], []]
    for e, engine in enumerate(node["rollout"]):
        assert engine["backend"] == "ray" and engine["in_group"]
        assert engine["workers"] == [rank_gpus[2 * e], rank_gpus[2 * e + 1]]
    assert [engine["gpus"] for engine in node["reward"]] == rank_gpus
    assert node["one_share_more"] is False, "the ranks' GPUs should be exactly full"


def test_colocated_tensor_parallel_engine_seats_name_the_ranks_bundles(placed):
    seats = placed["one_node"]["rollout_seats"]
    share = placed["one_node"]["rank_share"]
    assert [seat["num_gpus"] for seat in seats] == [0, 0]
    assert [seat["env"]["VLLM_RAY_PER_WORKER_GPUS"] for seat in seats] == [f"{share:g}"] * 2
    assert len({seat["env"]["VLLM_RAY_BUNDLE_INDICES"] for seat in seats}) == 2


def test_a_separate_tensor_parallel_engine_holds_its_gpus_and_runs_its_ranks_as_processes(placed):
    node = placed["one_node"]
    (engine,) = node["separate"]
    ranks = {rank["gpus"][0] for rank in node["ranks"]}
    assert len(engine["gpus"]) == 2 and not set(engine["gpus"]) & ranks
    assert node["separate_backend"] == "mp"


def test_a_rank_that_sees_every_gpu_takes_the_one_ray_assigned(placed):
    (rank,) = placed["one_node"]["noset"]
    assert rank["cuda_visible"] is None and rank["index"] == int(rank["gpus"][0])


def test_ranks_of_a_node_are_contiguous_on_two_nodes(placed):
    nodes = placed["two_nodes"]["nodes"]
    assert len(set(nodes)) == 2 and nodes[:4] == [nodes[0]] * 4 and nodes[4:] == [nodes[4]] * 4
    bundles = placed["two_nodes"]["bundles"]
    engine_bundles = [[int(b) for b in seat.split(",")] for seat in placed["two_nodes"]["engine_bundles"]]
    assert engine_bundles == [bundles[2 * e:2 * e + 2] for e in range(4)]


def test_a_node_that_does_not_share_the_run_directory_is_named(placed):
    """Two nodes on one filesystem pass; a third whose mount namespace puts another filesystem
    over the run's directory is refused in one line naming it."""
    nodes = placed["two_nodes"]
    assert nodes["shared"] == ""
    if "unavailable" in nodes["not_shared"]:
        pytest.skip(f"no node with a filesystem of its own on this machine: {nodes['not_shared']['unavailable']}")
    assert re.fullmatch(r"output_dir: node \S+ \(\w{8}\) does not see \S+ as this machine does; every node must "
                        r"share output_dir and the local model paths .*", nodes["not_shared"]["refusal"])


def test_a_node_without_a_hub_models_snapshot_fetches_its_own(placed, hub):
    """A model named by its Hub id is downloaded once per filesystem: by the driver, and by the third
    node (which sees another filesystem where HF_HOME is) before the run starts, to the same path."""
    nodes = placed["two_nodes"]
    if "unavailable" in nodes["not_shared"]:
        pytest.skip(f"no node with a filesystem of its own on this machine: {nodes['not_shared']['unavailable']}")
    assert nodes["not_shared"]["hub_fetch"] == ""  # the third node's empty filesystem now holds the snapshot
    assert hub[0].downloads[("test-org/tiny", "config.json")] >= 2  # (a request retried counts again)


@pytest.mark.quick
def test_ranks_are_numbered_node_by_node():
    assert ranks_by_node(["a", "b", "a", "b", "c", "a"]) == [0, 2, 5, 1, 3, 4]


@pytest.mark.quick
def test_a_tensor_parallel_engine_across_nodes_is_refused():
    ranks = RankPlacement(None, (0, 1, 2, 3, 4, 5), ("a", "a", "a", "b", "b", "b"))
    _check_one_node_each(ranks, 1, 2, "rollout")
    with pytest.raises(ConfigError, match=r"^rollout\.tensor_parallel_size: engine 1's 2 GPUs, those of training "
                                          r"ranks 2\.\.3, span nodes"):
        _check_one_node_each(ranks, 2, 2, "rollout")


@pytest.mark.quick
def test_colocated_engines_beyond_the_ranks_gpus_are_refused_on_gpus_only():
    engines = RolloutConfig(placement="colocated", num_engines=3)
    check_colocated_engines(engines, 2, 0, "rollout")  # on CPU they share the ranks' cores
    with pytest.raises(ConfigError, match=r"^rollout\.num_engines: 3 colocated engines x 1 GPU each"):
        check_colocated_engines(engines, 2, 1, "rollout")
    tp2 = RolloutConfig(placement="colocated", num_engines=2, tensor_parallel_size=2)
    check_colocated_engines(tp2, 4, 1, "rollout")
    with pytest.raises(ConfigError, match=r"= 4 GPUs, but the 2 training ranks hold 2"):
        check_colocated_engines(tp2, 2, 1, "rollout")


@pytest.mark.quick
def test_the_local_clusters_gpus_are_counted_as_ray_will_count_them(monkeypatch):
    monkeypatch.delenv("RAY_OVERRIDE_RESOURCES", raising=False)
    assert local_cluster_resources(RayConfig(num_cpus=3, num_gpus=2)) == {"CPU": 3, "GPU": 2}
    monkeypatch.setenv("RAY_OVERRIDE_RESOURCES", '{"GPU": 8}')
    assert local_cluster_resources(RayConfig(num_cpus=3))["GPU"] == 8


@pytest.fixture
def rl_yaml(tiny_model_dir, arith_files, tmp_path) -> str:
    """A small RLVR job of 2 ranks and one colocated engine."""
    config = tmp_path / "rl.yaml"
    config.write_text(yaml.safe_dump(rl_raw(tiny_model_dir, arith_files, str(tmp_path / "rl"))))
    return str(config)


REFUSALS = {  # name: (overrides, environment additions)
    "6-engines-on-2-gpus": (["rollout.num_engines=6"], {"RAY_OVERRIDE_RESOURCES": '{"GPU": 2}'}),
    "2-ranks-on-1-gpu": (["ray.gpus_per_worker=1"], {"RAY_OVERRIDE_RESOURCES": '{"GPU": 1}'}),
    # each stopped after the cluster's defaults by a later check of the config
    "cpu-set-beside-8-gpus": (["ray.gpus_per_worker=0", "algorithm.ppo_mini_batch_size=3"],
                              {"RAY_OVERRIDE_RESOURCES": '{"GPU": 8}'}),
    "cpu-beside-1-gpu": (["algorithm.ppo_mini_batch_size=3"], {"RAY_OVERRIDE_RESOURCES": '{"GPU": 1}'}),
    "cpu-without-gpus": (["algorithm.ppo_mini_batch_size=3"], {}),
    "separate-engine-beyond-the-gpus": (["rollout.placement=separate"], {"RAY_OVERRIDE_RESOURCES": '{"GPU": 2}'}),
}


@pytest.fixture(scope="module")
def refusals(tiny_model_dir, arith_files, tmp_path_factory) -> dict[str, tuple[int, str, str]]:
    """`rlvr` on a small job of 2 ranks and one colocated engine with each of REFUSALS' overrides and
    environment (tests/cli_runs.py: in one process); (exit code, stdout, stderr) by name."""
    tmp = tmp_path_factory.mktemp("refusals")
    config = tmp / "rl.yaml"
    config.write_text(yaml.safe_dump(rl_raw(tiny_model_dir, arith_files, str(tmp / "rl"))))
    commands = [(["rlvr", "--config", str(config), "ray.cpus_per_worker=1", *overrides], env)
                for overrides, env in REFUSALS.values()]
    return dict(zip(REFUSALS, run_commands(commands)))


@pytest.mark.quick
@pytest.mark.parametrize("gpus, overrides, expected", [
    (8, [], (1, 2, None)),  # the job's 2 ranks each on a GPU, an engine on each sized by its share of it
    (8, ["rollout.tensor_parallel_size=2"], (1, 1, None)),
    (8, ["parallel.dp_shard=4", "rollout.tensor_parallel_size=2"], (1, 2, None)),
    (8, ["rollout.placement=separate"], (1, 1, None)),  # an engine of its own, on a GPU of its own
    (1, [], (0, 1, 0.5)),  # fewer GPUs than ranks: on CPU (and said, below)
    (0, [], (0, 1, 0.5)),
    (8, ["ray.gpus_per_worker=0", "rollout.num_engines=3"], (0, 3, 0.5)),  # what the config sets stays
], ids=["8gpus", "8gpus-engine-tp2", "8gpus-4ranks-engine-tp2", "8gpus-separate", "1gpu", "cpu", "8gpus-set"])
def test_gpus_and_engines_left_empty_follow_the_clusters_gpus(rl_yaml, monkeypatch, gpus, overrides, expected):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_OVERRIDE_RESOURCES", json.dumps({"GPU": gpus}))
    cfg = load_config(RLJobConfig, rl_yaml, [*overrides, "rollout.engine_memory_gib=null"])
    assert (cfg.ray.gpus_per_worker, cfg.rollout.num_engines, cfg.rollout.engine_memory_gib) == expected
    assert load_config(RLJobConfig, rl_yaml, overrides).rollout.engine_memory_gib == 0.1  # as the job sets it


@pytest.mark.quick
def test_a_gpu_engine_left_unsized_takes_its_share_of_what_is_free(monkeypatch):
    """rollout.engine_memory_gib empty: 0.5 GiB of KV cache on CPU; on a GPU, vLLM's
    gpu_memory_utilization at rollout.gpu_memory_utilization, never above what is free (the
    device's reading stood in for: it needs CUDA)."""
    monkeypatch.setattr(vllm_engine, "free_memory_fraction", lambda: 0.3)
    assert vllm_engine.engine_memory(None, 0.5, on_gpu=False) == {"kv_cache_memory_bytes": 2**29}
    assert vllm_engine.engine_memory(None, 0.5, on_gpu=True) == {"gpu_memory_utilization": 0.3}
    assert vllm_engine.engine_memory(None, 0.2, on_gpu=True) == {"gpu_memory_utilization": 0.2}
    assert vllm_engine.engine_memory(2.0, 0.5, on_gpu=True) == {"kv_cache_memory_bytes": 2 * 2**30,
                                                                "gpu_memory_utilization": 0.3}


@pytest.mark.quick
def test_an_engine_whose_workers_sit_in_the_ranks_bundles_reads_free_memory_without_cuda(monkeypatch):
    """Its actor holds no GPU: the free share comes from NVML over the node's GPUs (the reading stood in
    for), never from a CUDA call, which would open a context on the node's first GPU (and raises here)."""
    monkeypatch.setenv("VLLM_RAY_BUNDLE_INDICES", "2,3")
    monkeypatch.setattr(vllm_engine, "least_free_share_of_node_gpus", lambda: 0.42)
    assert vllm_engine.free_memory_fraction() == pytest.approx(0.41)


@pytest.mark.quick
def test_more_colocated_engines_than_the_clusters_gpus_are_refused_before_ray_starts(refusals):
    """With Ray told of 2 GPUs, 2 ranks take a GPU each unasked (the cluster's GPUs are counted, not
    this machine's CUDA devices), pass the training check, and 6 colocated engines are refused in
    one line."""
    code, _, err = refusals["6-engines-on-2-gpus"]
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        "rlsys rlvr: error: rollout.num_engines: 6 colocated engines x 1 GPU each (tensor_parallel_size) = 6 GPUs, "
        "but the 2 training ranks hold 2 (one each, ray.gpus_per_worker=1); a colocated engine's ranks take one "
        "GPU each: set rollout.num_engines to at most 2 or rollout.placement: separate")
    code, _, err = refusals["2-ranks-on-1-gpu"]
    assert code == 2
    assert err.strip().splitlines()[-1].startswith(
        "rlsys rlvr: error: ray.gpus_per_worker: 2 workers x 1 GPUs = 2 GPUs, but the Ray cluster has 1; ")


@pytest.mark.quick
def test_separate_engines_take_gpus_of_their_own_and_are_refused_beyond_the_clusters(refusals):
    """On a cluster with GPUs a separate engine gets a GPU of its own unasked (on CPU it would generate
    slowly, unsaid); the 2 ranks' 2 GPUs and its own are more than the cluster's 2: one line."""
    code, _, err = refusals["separate-engine-beyond-the-gpus"]
    assert code == 2 and err.strip().splitlines()[-1] == (
        "rlsys rlvr: error: rollout.gpus_per_engine: the training ranks take 2 GPUs and the separate engines 1 of "
        "their own, 3 in all, but the Ray cluster has 2; lower rollout.num_engines or the parallel degrees, set "
        "rollout.placement: colocated, or rollout.gpus_per_engine: 0 to generate on CPU")


@pytest.mark.quick
def test_a_fraction_of_a_gpu_per_rank_is_refused(rl_yaml, capsys):
    assert main(["rlvr", "--config", rl_yaml, "ray.gpus_per_worker=0.5"]) == 2
    assert capsys.readouterr().err.strip() == (
        "rlsys rlvr: error: ray.gpus_per_worker: 0.5; a training rank drives one GPU (1; 0 trains on CPU): two "
        "ranks on one GPU are refused by NCCL, and engines share a rank's GPU by rollout.placement: colocated")


@pytest.mark.quick
def test_a_run_on_cpu_beside_the_clusters_gpus_says_so(refusals):
    """Set to 0, or left empty with fewer GPUs than ranks: one line before the run starts (here the
    run then stops at a later check of its config)."""
    said = "running on CPU, though the Ray cluster has {} GPUs: ray.gpus_per_worker is 0"
    for name, gpus in (("cpu-set-beside-8-gpus", 8), ("cpu-beside-1-gpu", 1)):
        code, _, err = refusals[name]
        assert code == 2 and said.format(gpus) in err, (name, err)
    code, _, err = refusals["cpu-without-gpus"]
    assert code == 2 and "running on CPU" not in err
