"""rlsys on an existing two-node Ray cluster: `ray start --head` (token authentication
on, dashboard on 127.0.0.1) and a second node joined with `ray start --address`, one
CPU each, so the two training ranks land on different nodes; then `ray job submit --
python -m rlsys.run rlvr ...`, the dashboard's HTTP API and the metrics endpoint, as a
user would look at them."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from test_rlvr import rl_raw

# One xdist worker runs this module (scripts/test.sh): the two-node cluster and its submitted job, started once.
pytestmark = pytest.mark.xdist_group("ray_cluster")

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
NODE_STARTS = 3
"""`ray start` gives up when its raylet has not registered within a fixed 30 s, which a loaded 2-core
machine can miss, the head's as well as the worker's: a node that gave up is started again."""
UP_S = 240
"""A running node's time to be listed alive: its raylet's start and registration, each of Ray's agents
importing Ray, on a loaded 2-core machine."""
JOB = "rlsys-test-job"
TOKEN = Path.home() / ".ray" / "auth_token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, token: str | None) -> dict | str:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as response:
        body = response.read().decode()
    return json.loads(body) if body.startswith(("{", "[")) else body


def alive_nodes(dashboard: str) -> int:
    """ALIVE nodes, or 0 while the head writes its token or its dashboard drops connections (it did once
    as the worker joined)."""
    try:
        nodes = get(f"{dashboard}/api/v0/nodes", TOKEN.read_text().strip())["data"]["result"]["result"]
    except (OSError, urllib.error.URLError):
        return 0
    return sum(n["state"] == "ALIVE" for n in nodes)


def start_node(args: list[str], env: dict, log_path: Path) -> subprocess.Popen:
    """`ray start --block ...` in its own process group: the node lives as long as the process."""
    return subprocess.Popen([RAY, "start", "--block", "--num-cpus=1", "--disable-usage-stats", *args], env=env,
                            stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def stop(node: subprocess.Popen) -> None:
    """The node's `ray start`, which stops its processes, then whatever of its process group is left (a
    `ray start` that gave up can leave its GCS or raylet behind)."""
    if node.poll() is None:
        node.terminate()
        try:
            node.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(node.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    node.wait()


def listed(count: int, dashboard: str, nodes: list[subprocess.Popen], log_path: Path) -> bool:
    """True once `count` nodes are listed alive; False as soon as one of `nodes` has given up."""
    up_by = time.monotonic() + UP_S
    while all(node.poll() is None for node in nodes):
        if alive_nodes(dashboard) >= count:
            return True
        assert time.monotonic() < up_by, f"no node {count} within {UP_S} s:\n{log_path.read_text()[-2000:]}"
        time.sleep(1)
    return False


def start_cluster(env: dict, logs: Path, started: list[subprocess.Popen]) -> dict:
    """A head and a worker node, each started again when its `ray start` gave up (the head on fresh
    ports, with a fresh worker). Every process started goes into `started`, for the caller to stop."""
    for attempt in range(NODE_STARTS):
        ports = {name: free_port() for name in ("gcs", "dashboard", "metrics", "agent", "client")}
        dashboard = f"http://127.0.0.1:{ports['dashboard']}"
        head = start_node(
            ["--head", f"--port={ports['gcs']}", "--dashboard-host=127.0.0.1", f"--dashboard-port={ports['dashboard']}",
             f"--metrics-export-port={ports['metrics']}",
             # fixed by default, so they would clash with another Ray instance on this machine
             f"--dashboard-agent-listen-port={ports['agent']}", f"--ray-client-server-port={ports['client']}"],
            env, logs / f"head-{attempt}.log")
        started.append(head)
        if not listed(1, dashboard, [head], logs / f"head-{attempt}.log"):
            continue
        for worker_attempt in range(NODE_STARTS):
            log = logs / f"worker-{attempt}-{worker_attempt}.log"
            worker = start_node([f"--address=127.0.0.1:{ports['gcs']}", f"--metrics-export-port={free_port()}",
                                 f"--dashboard-agent-listen-port={free_port()}"], env, log)
            started.append(worker)
            if listed(2, dashboard, [head, worker], log):
                return {"dashboard": dashboard, "metrics": f"http://127.0.0.1:{ports['metrics']}/metrics",
                        "token": TOKEN.read_text().strip(), "env": env}
            if head.poll() is not None:
                break
        stop(head)
    raise AssertionError(f"no two-node cluster in {NODE_STARTS} starts:\n"
                         + "\n".join(f"{log.name}: {log.read_text()[-600:]}" for log in sorted(logs.iterdir())))


@pytest.fixture(scope="module")
def head(tmp_path_factory, hub):
    """A 1-CPU head node and a 1-CPU worker node on this machine, each with the Hub settings a cluster's
    nodes would have (the test's hub as HF_ENDPOINT, one HF_HOME)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and not k.startswith("HF_")}
    env.update(RAY_AUTH_MODE="token", RAY_metrics_report_interval_ms="1000", HF_ENDPOINT=hub[1],
               HF_HOME=str(tmp_path_factory.mktemp("hf")), HF_HUB_DISABLE_PROGRESS_BARS="1",
               HF_HUB_ETAG_TIMEOUT="120", HF_HUB_DOWNLOAD_TIMEOUT="120")  # a loaded machine's server answers late
    started: list[subprocess.Popen] = []
    try:  # the nodes go with the fixture, also when it fails to bring them up
        yield start_cluster(env, tmp_path_factory.mktemp("nodes"), started)
    finally:
        for node in reversed(started):  # workers before their head
            stop(node)


@pytest.fixture(scope="module")
def submitted(head, arith_files, tmp_path_factory):
    """An RLVR job of the Hub's `test-org/tiny` sent with `ray job submit --no-wait`; while it runs, the
    metrics endpoint is scraped (Ray drops a process's metrics when it exits). Returns the job's config,
    its final state from the dashboard API and every rlsys metric line seen."""
    tmp = tmp_path_factory.mktemp("job")
    raw = rl_raw("test-org/tiny", arith_files, str(tmp / "rl"))  # fetched from the hub before the groups start
    raw["train"].update(steps=6, save_every=0)
    raw["tracking"]["backends"] = ["jsonl", "ray"]
    config = tmp / "rl.yaml"
    config.write_text(yaml.safe_dump(raw))
    command = [RAY, "job", "submit", "--no-wait", "--address", head["dashboard"], "--submission-id", JOB, "--",
               sys.executable, "-m", "rlsys.run", "rlvr", "--config", str(config)]
    for _ in range(10):  # the head's job agent starts a little after its dashboard
        result = subprocess.run(command, env=head["env"], capture_output=True, text=True, timeout=120)
        if "No available agent to submit job" not in result.stderr + result.stdout:
            break
        time.sleep(2)
    assert result.returncode == 0, result.stderr[-2000:]
    seen: dict[str, str] = {}
    deadline = time.monotonic() + 600
    while (job := get(f"{head['dashboard']}/api/jobs/{JOB}", head["token"]))["status"] in ("PENDING", "RUNNING"):
        assert time.monotonic() < deadline, "the job did not finish"
        seen.update({line.split("{")[0]: line for line in get(head["metrics"], token=None).splitlines()
                     if line.startswith("ray_rlsys_")})
        time.sleep(0.5)
    return raw, job, seen


def test_job_submit_runs_rlvr_on_the_cluster(submitted, head, hub):
    """The job trains a model named by its Hub id on both nodes: downloaded once (the nodes share this
    machine's HF_HOME, so the second finds the driver's snapshot) and loaded offline by every actor."""
    raw, job, _ = submitted
    assert job["status"] == "SUCCEEDED", job
    logs = get(f"{head['dashboard']}/api/jobs/{JOB}/logs", head["token"])["logs"]
    assert "[rlsys] connected to the Ray cluster at" in logs and "started a local Ray" not in logs
    for line in ("model.path: downloading test-org/tiny from", "model.path: test-org/tiny is",
                 "training group: starting 2 ranks, each loading its shard of", "training group: 2 ranks ready in",
                 "rollout: starting 1 vLLM engine of", "rlsys/rollout/0 ready in"):  # no silent minutes
        assert f"[rlsys] {line}" in logs, line
    rows = [json.loads(line) for line in open(os.path.join(raw["output_dir"], "metrics.jsonl"))]
    assert rows[-1]["step"] == 6
    assert hub[0].downloads[("test-org/tiny", "model.safetensors")] == 1
    resolved = yaml.safe_load(open(os.path.join(raw["output_dir"], "config.yaml")))["model"]["path"]
    assert resolved.startswith(head["env"]["HF_HOME"]), resolved


def test_dashboard_needs_the_token(head):
    with pytest.raises(urllib.error.HTTPError) as err:
        get(f"{head['dashboard']}/api/jobs/", token=None)
    assert err.value.code in (401, 403)


def test_dashboard_lists_the_named_actors_and_phases(submitted, head):
    actors = get(f"{head['dashboard']}/api/v0/actors?limit=1000&detail=true", head["token"])
    nodes = {a.get("name"): a["node_id"] for a in actors["data"]["result"]["result"]}
    assert {"rlsys/train/0", "rlsys/train/1", "rlsys/rollout/0", "rlsys/reward/0", "rlsys/val_reward/0"} <= set(nodes)
    assert nodes["rlsys/train/0"] != nodes["rlsys/train/1"]  # the ranks' all-reduces crossed nodes
    tasks = get(f"{head['dashboard']}/api/v0/tasks?limit=10000", head["token"])
    task_names = {t.get("name") for t in tasks["data"]["result"]["result"]}
    assert "rlvr step 3: generate: rollout" in task_names, sorted(task_names)[:20]
    assert "rlvr step 3: update: train_step" in task_names
    jobs = get(f"{head['dashboard']}/api/jobs/", head["token"])
    assert JOB in {j.get("submission_id") for j in jobs}


def test_run_metrics_reach_the_metrics_endpoint(submitted):
    _, _, seen = submitted
    for name in ("ray_rlsys_reward_mean", "ray_rlsys_val_accuracy", "ray_rlsys_throughput_tokens_per_s",
                 "ray_rlsys_time_generate_s", "ray_rlsys_sync_time_s", "ray_rlsys_step"):
        assert name in seen, (name, sorted(seen))
    assert 'run="rl"' in seen["ray_rlsys_step"]
    assert float(seen["ray_rlsys_step"].rsplit(" ", 1)[1]) >= 3
