"""Where the suite's start-up time goes: every Ray cluster, actor and engine start in a test process
(and in the actors and command-line runs it starts) appends a line to RLSYS_STARTUP_LOG
(`rlsys.console.record_startup`); each test's time span is written beside it, and the session's end
prints the start-ups per kind and the tests that spend the most on them.

The cost counted for an actor is the CPU its process used until it was ready (imports included); for
an engine built inside the test process, or a training rank kept from an earlier group
(`rlsys.actors.kept_actors`), the CPU its construction took; for a Ray cluster, the wall seconds it
took to start (its own processes' CPU is not seen)."""

from __future__ import annotations

import glob
import json
import os
import tempfile
import time
from collections import Counter, defaultdict

import pytest

from rlsys.console import STARTUP_LOG_ENV

DIR_ENV = "RLSYS_STARTUP_DIR"
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "main")
if not os.environ.get(DIR_ENV):  # the controller's choice reaches the xdist workers it starts
    os.environ[DIR_ENV] = tempfile.mkdtemp(prefix="rlsys-startups-")
DIR = os.environ[DIR_ENV]
os.environ[STARTUP_LOG_ENV] = os.path.join(DIR, f"startups-{WORKER}.jsonl")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    started = time.time()
    yield
    with open(os.path.join(DIR, f"tests-{WORKER}.jsonl"), "a") as f:
        f.write(json.dumps({"test": item.nodeid, "start": started, "end": time.time(), "pid": os.getpid()}) + "\n")


def cost(record: dict, test_pids: set[int]) -> float:
    """Seconds a start-up cost: see the module's docstring."""
    if record["kind"] == "ray_cluster":
        return record["init_s"]
    in_place = record["pid"] in test_pids or record.get("reused")  # the process's earlier CPU is not this start's
    return record["init_cpu_s"] if in_place else record["process_cpu_s"]


def read_lines(pattern: str) -> dict[str, list[dict]]:
    found = {}
    for path in glob.glob(os.path.join(DIR, pattern)):
        worker = os.path.basename(path).split("-", 1)[1].removesuffix(".jsonl")
        with open(path) as f:
            found[worker] = [json.loads(line) for line in f if line.strip()]
    return found


def startups_by_test() -> dict[str, list[tuple[str, float]]]:
    """Each test's start-ups, (kind, cost), by the test whose span holds them on the same worker."""
    tests, startups = read_lines("tests-*.jsonl"), read_lines("startups-*.jsonl")
    test_pids = {t["pid"] for spans in tests.values() for t in spans}
    by_test: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for worker, records in startups.items():
        spans = tests.get(worker, [])
        for record in records:
            owner = next((t["test"] for t in spans if t["start"] <= record["time"] <= t["end"]), "(between tests)")
            kind = record["kind"] + (" (kept)" if record.get("reused") else "")
            by_test[owner].append((kind, cost(record, test_pids)))
    return by_test


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if hasattr(config, "workerinput"):  # an xdist worker: the controller reports
        return
    by_test = startups_by_test()
    if not by_test:
        return
    write = terminalreporter.write_line
    terminalreporter.section("start-ups (Ray clusters, actors, engines)")
    kinds: dict[str, list[float]] = defaultdict(list)
    for costs in by_test.values():
        for kind, seconds in costs:
            kinds[kind].append(seconds)
    write(f"{'kind':<14} {'count':>6} {'seconds':>9} {'each':>6}")
    for kind, seconds in sorted(kinds.items(), key=lambda item: -sum(item[1])):
        write(f"{kind:<14} {len(seconds):>6} {sum(seconds):>9.0f} {sum(seconds) / len(seconds):>6.1f}")
    total = sum(sum(s) for s in kinds.values())
    write(f"{'all':<14} {sum(len(s) for s in kinds.values()):>6} {total:>9.0f}")
    write("")
    write("the 30 tests spending the most on start-ups (seconds, then count by kind):")
    ranked = sorted(by_test.items(), key=lambda item: -sum(seconds for _, seconds in item[1]))
    for test, costs in ranked[:30]:
        counts = Counter(kind for kind, _ in costs)
        write(f"{sum(s for _, s in costs):>7.0f}  {test}  " + " ".join(f"{k}x{n}" for k, n in sorted(counts.items())))
