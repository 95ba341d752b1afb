"""A dead worker outside the training group costs its replacement and nothing else: kill -9 of a
rollout engine, a reward worker and a teacher's engine, and a hung rollout engine, in the middle of a
short synchronous run, and the run finishes with every step's metrics equal to an uninterrupted run's,
without reading a checkpoint (none is written before the end) or restarting its training group; in an
asynchronous run the groups the dead engine had in flight are generated again and counted."""

from __future__ import annotations

import json
import os
import signal

import pytest
from faults import signal_after_steps

# One xdist worker runs this module (scripts/test.sh): the uninterrupted run its faults are compared
# against, built once.
pytestmark = pytest.mark.xdist_group("worker_restarts")

COMPARED = ("reward/mean", "reward/accuracy", "actor/pg_loss", "actor/kl", "actor/entropy", "actor/grad_norm",
            "distill/reverse_kl", "val/accuracy")


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


def test_dead_and_hung_workers_are_replaced_and_the_run_equals_the_uninterrupted_one(teacher_run, tmp_path,
                                                                                     monkeypatch):
    """One run, a fault after each of steps 1-3: the rollout engine killed (kill -9) after step 1, a
    reward worker after step 2, the teacher's engine after step 3, and the rollout engine that replaced
    the first stopped (SIGSTOP) after step 3, so that its step-4 call passes rollout.timeout_s and it is
    killed and replaced as a dead one is. Each is replaced in the step after its fault (the count each
    step logs), and every step's metrics equal the uninterrupted run's."""
    from dataclasses import replace

    from rlsys.stages.rl_trainer import run_rlvr

    straight, _ = teacher_run
    # the limit a hung engine's call passes: far above any healthy call of this run on a loaded machine
    cfg = replace(straight, output_dir=str(tmp_path / "run"), rollout=replace(straight.rollout, timeout_s=30.0),
                  train=replace(straight.train, max_worker_restarts=4))
    pending = signal_after_steps(monkeypatch, cfg.output_dir, {
        1: [("rollout-0", signal.SIGKILL)], 2: [("reward-1", signal.SIGKILL)],
        3: [("teacher-0", signal.SIGKILL), ("rollout-0", signal.SIGSTOP)]})
    summary = run_rlvr(cfg)
    assert not pending
    assert (summary["workers_replaced"], summary["restarts"], summary["resumed_from_step"]) == (4, 0, 0)
    assert os.listdir(os.path.join(cfg.output_dir, "checkpoints")) == ["step_000004"]  # the last step's only
    expected, got = logged(straight.output_dir), logged(cfg.output_dir)
    assert list(got) == [0, 1, 2, 3, 4]
    assert [got[step]["workers_replaced"] for step in (1, 2, 3, 4)] == [0, 1, 2, 4]
    for step in got:
        for name in COMPARED:
            assert got[step].get(name) == pytest.approx(expected[step].get(name), abs=1e-5), (step, name)


def test_in_async_rl_a_dead_engines_groups_are_generated_again(ray_cluster, tiny_model_dir, arith_files, tmp_path,
                                                                monkeypatch):
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
        "reward": {"terms": [{"name": "arith"}], "timeout_s": 10}, "optim": {"lr": 1e-3},
        "train": {"steps": 6, "prompts_per_step": 8, "micro_batch_size": 16, "save_every": 0, "val_every": 0,
                  "async_mode": "full", "max_staleness": 1},
        "ray": {"include_dashboard": False, "cpus_per_worker": 1}, "tracking": {"backends": ["jsonl"]}})
    pending = signal_after_steps(monkeypatch, cfg.output_dir, {2: [("rollout-0", signal.SIGKILL)]})
    summary = run_rlvr(cfg)
    assert not pending
    got = logged(cfg.output_dir)
    assert (summary["workers_replaced"], summary["restarts"]) == (1, 0) and list(got) == [1, 2, 3, 4, 5, 6]
    assert got[6]["async/regenerated_groups"] > 0 and got[2]["async/regenerated_groups"] == 0
