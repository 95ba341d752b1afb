"""What an actor's start-up writes where: its output goes to its log file, the libraries it imports
are quiet there without being imported to quiet them, and each start-up's cost is recorded."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.quick  # the quick tier (scripts/test.sh --quick)

# An actor's start: its output redirected, then what it imported, then the libraries imported late.
ACTOR = """
import json, logging, sys
from rlsys.console import redirect_actor_output
redirect_actor_output()
print("to the log file")
imported = [name for name in ("torch", "transformers", "datasets") if name in sys.modules]
import datasets, transformers
quiet = {"transformers": transformers.utils.logging.get_verbosity() == logging.WARNING
                         and not transformers.utils.logging.is_progress_bar_enabled(),
         "datasets": datasets.utils.logging.get_verbosity() == logging.WARNING
                     and not datasets.is_progress_bar_enabled()}
sys.__stdout__ = open(sys.argv[1], "w")
json.dump({"imported": imported, "quiet": quiet}, sys.__stdout__)
"""


def test_an_actor_quiets_the_libraries_it_imports_without_importing_them_to_do_it(tmp_path):
    """A reward or tool actor imports neither transformers nor datasets (nor torch) of its own: its
    output redirect does not import them (seconds of start-up each) and they are still quiet once
    it does."""
    log, result = tmp_path / "logs" / "reward-0.log", tmp_path / "result.json"
    env = {"RLSYS_LOG_FILE": str(log), "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", ACTOR, str(result)], env=env, check=True, timeout=120)
    assert json.loads(result.read_text()) == {"imported": [], "quiet": {"transformers": True, "datasets": True}}
    assert "to the log file" in log.read_text()


def test_a_start_up_is_recorded_with_its_cost(tmp_path, monkeypatch):
    """With RLSYS_STARTUP_LOG set, each start-up appends one JSON line: its kind, process, the wall
    and CPU seconds since its clock started, and its process's CPU and age."""
    import os
    import time

    from rlsys.console import STARTUP_LOG_ENV, StartupClock, record_startup

    path = tmp_path / "startups.jsonl"
    monkeypatch.setenv(STARTUP_LOG_ENV, str(path))
    clock = StartupClock()
    busy_until = time.process_time() + 0.2
    while time.process_time() < busy_until:
        pass
    record_startup("train", clock)
    record_startup("rollout", StartupClock())
    first, second = (json.loads(line) for line in path.read_text().splitlines())
    assert first["kind"] == "train" and second["kind"] == "rollout" and first["pid"] == os.getpid()
    assert 0.2 <= first["init_cpu_s"] <= first["process_cpu_s"] and first["init_s"] >= 0.2
    assert first["process_s"] >= first["init_s"] and second["init_cpu_s"] < first["init_cpu_s"]


def test_a_long_phase_is_heard_from_until_the_next_begins(caplog):
    """The heartbeat says that a phase goes on, once each period it lasts, and stops with the phase."""
    import logging
    import time

    from rlsys.actors.phases import Heartbeat, set_phase

    with caplog.at_level(logging.INFO, logger="rlsys"), Heartbeat(every_s=0.4):
        set_phase("rlvr step 7: generate")
        time.sleep(1.0)
        set_phase("rlvr step 7: reward")
        time.sleep(0.2)
    beats = [r.getMessage() for r in caplog.records if "still running" in r.getMessage()]
    assert [b.split(": still")[0] for b in beats] == ["rlvr step 7: generate"] * 2, beats
