"""Asynchronous RL on a training rank and an engine of its own: a rollout in flight goes on
under new weights, each token labelled with (and scored by) the weights that sampled it; the
staleness bound holds, with drops counted; every prompt is trained once; a dead rank costs a
restart and the run goes on, repeating what an uninterrupted run logs (one_step with whole
syncs by itself; full mode with a tool loop by following the uninterrupted run's schedule)."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import ray
import torch
import worker_probes as probes
import yaml

from rlsys.actors.rollout_worker import RolloutWorker
from rlsys.config.loader import load_config
from rlsys.config.schema import RLJobConfig
from rlsys.data.batching import collate_rollouts
from rlsys.rl.run_schedule import read_schedule
from rlsys.stages.rl_trainer import RLVRTrainer, run_rlvr

# One xdist worker runs this module (scripts/test.sh): the tool-calling model, built once, with test_agents'.
pytestmark = pytest.mark.xdist_group("tool_caller")


@pytest.fixture
def async_config(tiny_model_dir, arith_files, tmp_path):
    """1 training rank and 1 engine of its own (a core each), 8 prompts x 4 a step."""
    raw = {
        "output_dir": str(tmp_path / "rl"),
        "model": {"path": tiny_model_dir},
        "data": {"train_files": [arith_files["rl_train"]]},
        "rollout": {"n": 4, "max_new_tokens": 6, "engine_memory_gib": 0.1, "placement": "separate"},
        "reward": {"terms": [{"name": "arith"}], "timeout_s": 10},
        "optim": {"lr": 1e-3},
        "train": {"steps": 12, "prompts_per_step": 8, "micro_batch_size": 16, "save_every": 0, "val_every": 0,
                  "async_mode": "full", "max_staleness": 1},
        "ray": {"include_dashboard": False, "cpus_per_worker": 1},
        "tracking": {"backends": ["jsonl"]},
    }
    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump(raw))
    return lambda *overrides: load_config(RLJobConfig, str(path), list(overrides))


LONG_RESPONSE = 120
"""Tokens `sample_across_a_sync` asks for: its trainer's engines must be built for them (rollout.max_model_len)."""


def sample_across_a_sync(trainer: RLVRTrainer, indices, seed: int):
    """Two long responses to each of the prompts at `indices`, sampled while perturbed weights are
    synced as version 1; each sample's prompt ids as the trainer reads them; the trainer's log-probs
    of the samples under version 0's and under version 1's weights (the policy is left at version 0's)."""
    prompts = [(i, trainer.prompts[i].ids, trainer.prompts[i].row) for i in indices]
    sampling = trainer.rollout_group.sampling(max_new_tokens=LONG_RESPONSE)
    stepped = engine_seconds(trainer)
    ref = trainer.rollout_group.submit(0, RolloutWorker.rollout, prompts, "single_turn", 2, sampling, 7)
    deadline = time.monotonic() + 300
    while engine_seconds(trainer) == stepped:  # the sync goes in once the engine has sampled a token of them
        assert time.monotonic() < deadline, "the engine took no step"
        time.sleep(0.01)
    trainer.train_group.on_each(probes.perturb_parameters, 0.05, seed)
    trainer.sync.run(version=1)
    samples = trainer.rollout_group.wait([ref], [0])[0].unpack({i: ids for i, ids, _ in prompts})
    prompt_ids, pixels = trainer.rl_step.prompts_with_pictures(samples)
    batch = collate_rollouts(prompt_ids, [s.response_ids for s in samples], trainer.tokenizer.pad_token_id,
                             prompt_pixels=pixels)
    new = trainer.rl_step.passes.policy(batch)[0]
    trainer.train_group.on_each(probes.perturb_parameters, -0.05, seed)  # back to version 0's weights
    return samples, prompt_ids, trainer.rl_step.passes.policy(batch)[0], new


def engine_seconds(trainer: RLVRTrainer) -> float:
    """The seconds engine 0 has spent in its steps so far (it grows with each step)."""
    return trainer.rollout_group.on_each(lambda worker: worker.engine.step_s)[0]


def assert_each_token_scored_by_its_weights(samples, prompt_ids, old: torch.Tensor, new: torch.Tensor) -> None:
    """Some samples hold tokens of both versions, version 0's first; the engine's log-prob of each
    token equals the trainer's under its version's weights within 1e-4."""
    assert any(set(s.versions) == {0, 1} for s in samples), "the sync landed after every response had finished"
    for row, (ids, sample) in enumerate(zip(prompt_ids, samples)):
        assert len(sample.versions) == len(sample.response_ids) == len(sample.logprobs)
        assert sample.versions == sorted(sample.versions)  # version 0, then version 1
        for version, reference in ((0, old), (1, new)):
            tokens = [t for t, v in enumerate(sample.versions) if v == version]
            if tokens:
                trainer_logprobs = reference[row, [len(ids) + t for t in tokens]]
                engine_logprobs = torch.tensor([sample.logprobs[t] for t in tokens])
                assert (trainer_logprobs - engine_logprobs).abs().max() < 1e-4, (row, version)


def test_asynchronous_steps_train_every_prompt_once_within_the_staleness_bound(ray_cluster, async_config):
    """12 steps of `full`: no trained token is older than max_staleness versions, and every prompt
    drawn is trained once or still in flight; with max_staleness 0 stale groups are dropped,
    counted, and their prompts generated again. Before the steps with max_staleness 1, weights
    arrive while long responses are being sampled: each response keeps every token it sampled, the
    tokens after the sync say version 1, and the engine's log-prob of every token equals the
    trainer's under the weights of that token's version (`sample_across_a_sync`; version 0's weights
    are synced back before the steps)."""
    for max_staleness in (1, 0):
        # the engine built for the long responses of the sync in flight; the run's own budget is 6 tokens
        cfg = async_config(f"train.max_staleness={max_staleness}", f"rollout.max_model_len={LONG_RESPONSE + 64}")
        trainer = RLVRTrainer(cfg)
        trained: list[int] = []
        take = trainer.stream.take

        def recorded(count, version):
            groups = take(count, version)
            trained.extend(group[0].prompt_index for group in groups)
            return groups

        trainer.stream.take = recorded
        try:
            if max_staleness == 1:
                samples, prompt_ids, old, new = sample_across_a_sync(trainer, range(8), cfg.seed)
                assert_each_token_scored_by_its_weights(samples, prompt_ids, old, new)
                trainer.sync.run(version=0)
            rows = [trainer.step(step) for step in range(1, cfg.train.steps + 1)]
            still = [g.index for g in trainer.stream.in_flight] + trainer.stream.again
            drawn = trainer.sampler.offset  # one epoch: 12 steps draw far fewer prompts than it holds
        finally:
            trainer.shutdown()
        assert max(r["async/staleness_max"] for r in rows) <= max_staleness
        assert len(trained) == len(set(trained)) == cfg.train.steps * cfg.train.prompts_per_step
        assert sorted(trained + still) == sorted(set(trained + still)) and len(trained + still) == drawn
        if max_staleness == 0:
            assert rows[-1]["async/dropped_groups"] > 0


def test_a_dead_rank_in_an_asynchronous_run_costs_a_restart_and_changes_nothing(ray_cluster, async_config,
                                                                                moe_model_dir, tmp_path,
                                                                                monkeypatch):
    """train.max_restarts=1: a training rank of an MoE policy with routing replay (R2) killed after
    step 3 (the newest checkpoint: step 2's); the groups are built again and the run finishes. The
    checkpoint held the groups generated ahead, so with syncs that wait for them (partial_rollout: false) every step
    logs what an uninterrupted run logs, to the last digit, with no schedule to follow. The same with
    the uninterrupted run's schedule followed: the engine was idle when the step-2 sync landed, just
    before the checkpoint, and the resumed engine, which gets the step-2 weights from the restore, has
    no such sync to wait for."""
    from faults import signal_after_steps

    overrides = ("train.steps=4", "train.save_every=2", "train.async_mode=one_step", "train.partial_rollout=false",
                 f"model.path={moe_model_dir}", "algorithm.router_replay=r2", "algorithm.ppo_mini_batch_size=4")
    uninterrupted = async_config(*overrides, f"output_dir={tmp_path / 'uninterrupted'}")
    run_rlvr(uninterrupted)
    figures = ("reward/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm", "async/staleness_mean",
               "router/replay_agreement", "router/max_load")
    reference = _steps(uninterrupted.output_dir, figures)
    for name, follow in (("restarted", ()), ("followed", (f"train.replay={uninterrupted.output_dir}",))):
        cfg = async_config(*overrides, "train.max_restarts=1", f"output_dir={tmp_path / name}", *follow)
        pending = signal_after_steps(monkeypatch, cfg.output_dir, {3: [("train-0", signal.SIGKILL)]})
        summary = run_rlvr(cfg)
        assert not pending and summary["restarts"] == 1 and summary["resumed_from_step"] == 2 and ray.is_initialized()
        assert _steps(cfg.output_dir, figures) == reference, name  # steps 1-2: runs alike; 3-4: a restart too


def test_a_tool_loop_run_followed_from_its_schedule_repeats_it_through_a_restart(ray_cluster, async_config,
                                                                                 tool_caller, tmp_path,
                                                                                 monkeypatch):
    """`full` mode with partial rollouts and a multi-turn tool loop, where the clock decides which
    weights sample what, when a tool's result joins the engine's batch and which groups a step
    trains on: a run records its schedule; a second run follows it (`train.replay`) and has a
    training rank killed after step 3 (max_restarts=1: it resumes from the step-2 checkpoint). Every
    step of the second run logs what the first logged, and its schedule, written again after the
    restart, holds the first's takes and engine events.
    Weights go bucket by bucket, a call each: no engine step may run between the first and the last."""
    from conftest import CALL, EXPRESSION, QUESTION
    from datasets import Dataset
    from faults import signal_after_steps

    from rlsys.tools.builtin import calculator

    prompts = str(tmp_path / "calls.parquet")  # the question the model learned to call the calculator for
    Dataset.from_list([{"data_source": "calc", "prompt": [{"role": "user", "content": QUESTION}],
                        "reward_model": {"ground_truth": str(eval(EXPRESSION))}}] * 16).to_parquet(prompts)
    overrides = ("train.steps=4", "train.save_every=2", f"model.path={tool_caller}", f"data.train_files=[{prompts}]",
                 "reward.terms=[{name: calc}]", "optim.lr=1e-4", "rollout.agent_loop=tool", "rollout.max_new_tokens=96",
                 "rollout.max_response_tokens=160",
                 "tools.names=[calculator]", "tools.max_turns=2", "tools.num_workers=1",
                 "rollout.sync_mode=object_store", "rollout.sync_bucket_mb=0.05",  # syncs of several calls
                 "tracking.log_samples_every=1")
    recorded = async_config(*overrides, f"output_dir={tmp_path / 'recorded'}")
    run_rlvr(recorded)
    cfg = async_config(*overrides, "train.max_restarts=1", f"train.replay={recorded.output_dir}")
    pending = signal_after_steps(monkeypatch, cfg.output_dir, {3: [("train-0", signal.SIGKILL)]})
    summary = run_rlvr(cfg)
    assert not pending and summary["restarts"] == 1 and summary["resumed_from_step"] == 2
    figures = ("reward/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm", "async/staleness_mean",
               "agent/tool_calls_mean")
    reference, followed = (_steps(c.output_dir, figures) for c in (recorded, cfg))
    assert followed == reference
    assert all(row["agent/tool_calls_mean"] > 0 for row in reference.values())
    assert sum(row["actor/grad_norm"] > 0 for row in reference.values()) >= 2  # (a step all right has no gradient)
    assert any(row["async/staleness_mean"] > 0 for row in reference.values())  # syncs landed mid-generation
    # the same takes in each step and the same events of each engine in order; which line holds an
    # engine's event is when the driver asked for them (the clock), not part of what was decided
    schedules = [read_schedule(c.output_dir) for c in (recorded, cfg)]
    assert [(line["step"], line["taken"]) for line in schedules[0]] == \
        [(line["step"], line["taken"]) for line in schedules[1]]
    assert [_engine_events(schedule) for schedule in schedules[1:]] == [_engine_events(schedules[0])]
    # what the model said: each step's samples once (the restart's redone step replaced), the tool turns in them
    samples = [json.loads(line) for line in open(os.path.join(cfg.output_dir, "samples.jsonl"))]
    assert [r["step"] for r in samples] == [step for step in range(1, 5) for _ in range(cfg.tracking.samples_per_log)]
    assert any(r["turns"] == 2 and r["tool_calls"] == 1 and CALL in r["response"]
               and calculator(EXPRESSION) in r["response"] for r in samples)


def _engine_events(schedule: list[dict]) -> list[list]:
    """Each engine's events over the whole schedule, in order."""
    return [[event for line in schedule for event in line["engines"][engine]]
            for engine in range(len(schedule[0]["engines"]))]


def _steps(output_dir: str, figures: tuple[str, ...]) -> dict[int, dict[str, float]]:
    """The figures each step logged last (a resumed run logs its steps again)."""
    rows = [json.loads(line) for line in open(os.path.join(output_dir, "metrics.jsonl"))]
    return {row["step"]: {name: row[name] for name in figures} for row in rows if "actor/pg_loss" in row}


@pytest.mark.quick
def test_a_checkpoint_holds_a_trajectory_whole():
    """What a checkpoint keeps of a group in flight comes back equal through JSON, an MoE routing too."""
    import numpy as np

    from rlsys.agents.trajectory import Trajectory
    from rlsys.rl.rollout_stream import _restored, _saved

    routing = np.arange(24, dtype=np.uint8).reshape(3, 4, 2)
    trajectory = Trajectory(0, [1, 2], [3, 4], [1, 0], [-0.5], [2], "34", "stop", num_turns=2,
                            reward_info={"final_turn": "4"}, routing=routing)
    back = _restored(json.loads(json.dumps(_saved(trajectory))))
    assert np.array_equal(back.routing, routing) and back.routing.dtype == routing.dtype
    assert {**vars(back), "routing": None} == {**vars(trajectory), "routing": None}


@pytest.mark.quick
def test_a_followed_schedule_holds_each_step_for_its_requests_and_its_sync():
    """An engine following a record adds before each step the requests recorded for it, in the
    recorded order, once they have all arrived; a step recorded after a sync waits for that sync,
    and a sync waits for its step; a sync out of place is an error; past the record (its last sync
    landed), the clock."""
    import asyncio

    from rlsys.rollout.schedule import EngineSchedule, ScheduleDiverged

    async def finishes(awaitable) -> bool:
        try:
            await asyncio.wait_for(awaitable, 0.05)
            return True
        except asyncio.TimeoutError:
            return False

    async def follow() -> None:
        schedule = EngineSchedule()
        schedule.follow([[0, "add", "a"], [0, "add", "b"], [1, "sync", 1], [1, "add", "c"], [2, "add", "c"],
                         [3, "sync", 2]], 0)
        assert not await finishes(schedule.wait_for_step(lambda: ["b"]))
        assert await finishes(schedule.wait_for_step(lambda: ["b", "x", "a"]))
        assert schedule.due(["b", "x", "a"]) == ["a", "b"]
        assert not await finishes(schedule.wait_for_sync())  # the sync belongs before step 1
        schedule.stepped()
        assert await finishes(schedule.wait_for_sync())
        assert not await finishes(schedule.wait_for_step(lambda: ["c"]))  # the sync has not landed
        with pytest.raises(ScheduleDiverged):
            schedule.synced(2)
        schedule.synced(1)
        assert await finishes(schedule.wait_for_step(lambda: ["c"]))
        schedule.stepped()
        assert not await finishes(schedule.wait_for_step(lambda: ["x"]))  # the second "c" has not arrived
        schedule.stepped()
        assert not await finishes(schedule.wait_for_step(lambda: ["x"]))  # the record's last sync has not landed
        schedule.synced(2)
        assert not schedule.following and schedule.due(["x", "y"]) == ["x", "y"]  # past the record: the clock
        assert schedule.take() == [[1, "sync", 1], [3, "sync", 2]]  # what landed, where

    asyncio.run(follow())
