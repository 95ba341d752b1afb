"""rlsys on an existing two-node Ray cluster: `ray start --head` (token authentication
on, dashboard on 127.0.0.1) and a second node joined with `ray start --address`, one
CPU each, so the two training ranks land on different nodes; then `ray job submit --
python -m rlsys.run rlvr ...`, the dashboard's HTTP API and the metrics endpoint, as a
user would look at them."""

from __future__ import annotations

import json
import os
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
WORKER_STARTS = 3
JOIN_S = 240
"""A running worker node's time to be listed alive: its raylet's start and registration, each of Ray's
agents importing Ray, on a loaded 2-core machine (the three attempts and the head fit pytest's 900 s)."""
JOB = "rlsys-test-job"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, token: str | None) -> dict | str:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as response:
        body = response.read().decode()
    return json.loads(body) if body.startswith(("{", "[")) else body


def alive_nodes(dashboard: str, token: str) -> int:
    """ALIVE nodes, or 0 while the dashboard drops connections (it did once as the worker joined)."""
    try:
        nodes = get(f"{dashboard}/api/v0/nodes", token)["data"]["result"]["result"]
    except (OSError, urllib.error.URLError):
        return 0
    return sum(n["state"] == "ALIVE" for n in nodes)


def start_node(args: list[str], env: dict, log_path: Path) -> subprocess.Popen:
    """`ray start --block ...` in its own process group: the node lives as long as the process."""
    return subprocess.Popen([RAY, "start", "--block", "--num-cpus=1", "--disable-usage-stats", *args], env=env,
                            stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True)


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """A 1-CPU head node and a 1-CPU worker node on this machine."""
    ports = {name: free_port() for name in ("gcs", "dashboard", "metrics", "agent", "client")}
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="token", RAY_metrics_report_interval_ms="1000")
    logs = tmp_path_factory.mktemp("nodes")
    process = start_node(
        ["--head", f"--port={ports['gcs']}", "--dashboard-host=127.0.0.1", f"--dashboard-port={ports['dashboard']}",
         f"--metrics-export-port={ports['metrics']}",
         # fixed by default, so they would clash with another Ray instance on this machine
         f"--dashboard-agent-listen-port={ports['agent']}", f"--ray-client-server-port={ports['client']}"],
        env, logs / "head.log")
    token = (Path.home() / ".ray" / "auth_token")
    dashboard = f"http://127.0.0.1:{ports['dashboard']}"
    deadline = time.monotonic() + 120
    nodes = [process]
    try:  # the nodes go with the fixture, also when it fails to bring them up
        while True:
            assert process.poll() is None, (logs / "head.log").read_text()[-3000:]
            try:
                get(f"{dashboard}/api/version", token.read_text().strip())
                break
            except (OSError, urllib.error.URLError):
                assert time.monotonic() < deadline, "the dashboard did not come up"
                time.sleep(1)
        # `ray start` gives up when its raylet has not registered within a fixed 30 s, which a loaded
        # 2-core machine can miss: a node that gave up is started again. One that runs is given
        # JOIN_S from its own start to be listed alive (each attempt's own limit, not the head's).
        for attempt in range(WORKER_STARTS):
            worker = start_node([f"--address=127.0.0.1:{ports['gcs']}", f"--metrics-export-port={free_port()}",
                                 f"--dashboard-agent-listen-port={free_port()}"], env, logs / f"worker-{attempt}.log")
            nodes.insert(0, worker)
            joined_by = time.monotonic() + JOIN_S
            while alive_nodes(dashboard, token.read_text().strip()) < 2 and worker.poll() is None:
                assert time.monotonic() < joined_by, (f"the worker node did not join within {JOIN_S} s:\n"
                                                      f"{(logs / f'worker-{attempt}.log').read_text()[-2000:]}")
                time.sleep(1)
            if worker.poll() is None:
                break
        assert worker.poll() is None, (logs / f"worker-{attempt}.log").read_text()[-3000:]
        yield {"dashboard": dashboard, "metrics": f"http://127.0.0.1:{ports['metrics']}/metrics",
               "token": token.read_text().strip(), "env": env}
    finally:
        for node in nodes:
            node.terminate()
            node.wait(timeout=60)


@pytest.fixture(scope="module")
def submitted(head, tiny_model_dir, arith_files, tmp_path_factory):
    """An RLVR job sent with `ray job submit --no-wait`; while it runs, the metrics endpoint is
    scraped (Ray drops a process's metrics when it exits). Returns the job's config, its final
    state from the dashboard API and every rlsys metric line seen."""
    tmp = tmp_path_factory.mktemp("job")
    raw = rl_raw(tiny_model_dir, arith_files, str(tmp / "rl"))
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


def test_job_submit_runs_rlvr_on_the_cluster(submitted, head):
    raw, job, _ = submitted
    assert job["status"] == "SUCCEEDED", job
    logs = get(f"{head['dashboard']}/api/jobs/{JOB}/logs", head["token"])["logs"]
    assert "[rlsys] connected to the Ray cluster at" in logs and "started a local Ray" not in logs
    rows = [json.loads(line) for line in open(os.path.join(raw["output_dir"], "metrics.jsonl"))]
    assert rows[-1]["step"] == 6


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
