"""A dead worker outside the training group costs its replacement and nothing else: kill -9 of a
rollout engine, a reward worker or a teacher's engine in the middle of a short synchronous run,
and the run finishes with every step's metrics equal to an uninterrupted run's, without reading a
checkpoint (none is written before the end) or restarting its training group; in an asynchronous run the groups
the dead engine had in flight are generated again and counted."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
from test_failures import worker_process

COMPARED = ("reward/mean", "reward/accuracy", "actor/pg_loss", "actor/kl", "actor/entropy", "actor/grad_norm",
            "distill/reverse_kl", "val/accuracy")


def steps_logged(output_dir: str) -> int:
    path = os.path.join(output_dir, "metrics.jsonl")
    return sum(1 for line in open(path) if '"step": 0' not in line) if os.path.isfile(path) else 0


def kill_after_step(output_dir: str, step: int, worker: str) -> threading.Thread:
    """A thread that kills -9 the actor `worker` (rollout-0, reward-1 ...) once `step` steps are logged."""
    def kill() -> None:
        while steps_logged(output_dir) < step:
            time.sleep(0.05)
        worker_process(os.path.join(output_dir, "logs"), worker).kill()

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    return killer


def logged(output_dir: str) -> dict[int, dict]:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return {row["step"]: row for row in map(json.loads, f)}


@pytest.fixture(scope="module")
def teacher_run(ray_cluster, tiny_model_dir, arith_files, tmp_path_factory):
    """test_rlvr's small job (2 FSDP2 ranks, a colocated engine, two reward workers) distilling a
    teacher served by its own engine, 4 steps with validation at 2 and 4 and no checkpoint; the
    uninterrupted run and the config."""
    from test_rlvr import rl_raw

    from rlsys.config.loader import build_config
    from rlsys.config.schema import RLJobConfig
    from rlsys.stages.rl_trainer import run_rlvr

    raw = rl_raw(tiny_model_dir, arith_files, str(tmp_path_factory.mktemp("straight") / "run"))
    raw["train"]["save_every"] = 0
    raw["algorithm"]["distill"] = {"teacher": tiny_model_dir, "coef": 0.1, "serving": {"engine_memory_gib": 0.1}}
    cfg = build_config(RLJobConfig, raw)
    return cfg, run_rlvr(cfg)


@pytest.mark.parametrize("worker", ["rollout-0", "reward-1", "teacher-0"])
def test_a_dead_worker_is_replaced_and_the_run_equals_the_uninterrupted_one(teacher_run, tmp_path, worker):
    from dataclasses import replace

    from rlsys.stages.rl_trainer import run_rlvr

    straight, _ = teacher_run
    cfg = replace(straight, output_dir=str(tmp_path / "run"))
    killer = kill_after_step(cfg.output_dir, 1, worker)
    summary = run_rlvr(cfg)
    killer.join(timeout=60)
    assert (summary["workers_replaced"], summary["restarts"], summary["resumed_from_step"]) == (1, 0, 0)
    assert os.listdir(os.path.join(cfg.output_dir, "checkpoints")) == ["step_000004"]  # the last step's only
    expected, got = logged(straight.output_dir), logged(cfg.output_dir)
    assert list(got) == [0, 1, 2, 3, 4] and got[1]["workers_replaced"] == 0 and got[4]["workers_replaced"] == 1
    for step in got:
        for name in COMPARED:
            assert got[step].get(name) == pytest.approx(expected[step].get(name), abs=1e-5), (worker, step, name)


def test_a_hung_engine_is_replaced_after_its_call_limit(teacher_run, tmp_path):
    """A rollout engine stopped (SIGSTOP) after step 1 answers nothing: its next call passes
    rollout.timeout_s, the engine is killed and replaced like a dead one, and the run equals the
    uninterrupted one."""
    import signal
    from dataclasses import replace

    from rlsys.stages.rl_trainer import run_rlvr

    straight, _ = teacher_run
    cfg = replace(straight, output_dir=str(tmp_path / "run"), rollout=replace(straight.rollout, timeout_s=20.0))

    def stop() -> None:
        while steps_logged(cfg.output_dir) < 1:
            time.sleep(0.05)
        worker_process(os.path.join(cfg.output_dir, "logs"), "rollout-0").send_signal(signal.SIGSTOP)

    stopper = threading.Thread(target=stop, daemon=True)
    stopper.start()
    summary = run_rlvr(cfg)
    stopper.join(timeout=60)
    assert (summary["workers_replaced"], summary["restarts"]) == (1, 0)
    expected, got = logged(straight.output_dir), logged(cfg.output_dir)
    for step in got:
        for name in COMPARED:
            assert got[step].get(name) == pytest.approx(expected[step].get(name), abs=1e-5), (step, name)


def test_in_async_rl_a_dead_engines_groups_are_generated_again(ray_cluster, tiny_model_dir, arith_files, tmp_path):
    """Asynchronous RL (full mode): the engine killed after step 2 is replaced with the trainer's
    current weights, the groups it had in flight are generated again and counted, and the run
    trains every step."""
    from rlsys.config.loader import build_config
    from rlsys.config.schema import RLJobConfig
    from rlsys.stages.rl_trainer import run_rlvr

    cfg = build_config(RLJobConfig, {
        "output_dir": str(tmp_path / "rl"), "model": {"path": tiny_model_dir},
        "data": {"train_files": [arith_files["rl_train"]]},
        "rollout": {"n": 4, "max_new_tokens": 6, "engine_memory_gib": 0.1, "placement": "separate"},
        "reward": {"terms": [{"name": "arith"}], "timeout_s": 2}, "optim": {"lr": 1e-3},
        "train": {"steps": 6, "prompts_per_step": 8, "micro_batch_size": 16, "save_every": 0, "val_every": 0,
                  "async_mode": "full", "max_staleness": 1},
        "ray": {"include_dashboard": False, "cpus_per_worker": 1}, "tracking": {"backends": ["jsonl"]}})
    killer = kill_after_step(cfg.output_dir, 2, "rollout-0")
    summary = run_rlvr(cfg)
    killer.join(timeout=60)
    got = logged(cfg.output_dir)
    assert (summary["workers_replaced"], summary["restarts"]) == (1, 0) and list(got) == [1, 2, 3, 4, 5, 6]
    assert got[6]["async/regenerated_groups"] > 0 and got[2]["async/regenerated_groups"] == 0
