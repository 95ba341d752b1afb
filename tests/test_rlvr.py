"""RLVR on CPU: weight sync from 2 FSDP2 ranks to a vLLM engine, and the loop end to end."""

from __future__ import annotations

import copy
import glob
import json
import math
import os
import resource
import signal
import struct
import time
from dataclasses import replace

import pytest
import ray
import torch
import worker_probes as probes

from rlsys.actors.failures import WorkerFailure
from rlsys.actors.rollout_worker import RolloutWorker
from rlsys.actors.train_worker import TrainWorker
from rlsys.algorithms.lm_loss import logprobs_and_sum_pi_squared
from rlsys.algorithms.value_loss import token_values
from rlsys.config.loader import build_config
from rlsys.config.schema import RLJobConfig
from rlsys.config.training import TrackingConfig
from rlsys.data.batching import collate_rollouts
from rlsys.rl.batch import RLBatch
from rlsys.rl.remax import ReMax
from rlsys.rl.weight_sync import WeightSync, _gpus_unseen, _Host, plan_buckets
from rlsys.stages.rl_trainer import RLVRTrainer, run_rlvr

# One xdist worker runs this module (scripts/test.sh): the uninterrupted run its tests read, built once.
pytestmark = pytest.mark.xdist_group("rlvr")

FLAKY = os.path.join(os.path.dirname(__file__), "assets", "flaky_reward.py")
MARKER = os.path.join(os.path.dirname(__file__), "assets", "marker_reward.py")
COIN = os.path.join(os.path.dirname(__file__), "assets", "coin_reward.py")


def rl_raw(model_dir: str, files: dict[str, str], output_dir: str) -> dict:
    """A small RLVR job on 2 FSDP2 ranks + 1 colocated engine, with a KL term and 2x2 updates per step."""
    return {
        "output_dir": output_dir,
        "model": {"path": model_dir},
        "data": {"train_files": [files["rl_train"]]},
        "rollout": {"n": 4, "max_new_tokens": 6, "engine_memory_gib": 0.1, "sync_bucket_mb": 0.05},
        # a reward item's time limit far above its scoring's on a loaded machine (runs are compared to 1e-5)
        "reward": {"terms": [{"name": "arith"}, {"path": FLAKY, "weight": 0.5}], "timeout_s": 10},
        "optim": {"lr": 1e-3},
        "train": {"steps": 4, "prompts_per_step": 8, "micro_batch_size": 8, "save_every": 2, "val_every": 2},
        "algorithm": {"kl_coef": 0.01, "ppo_mini_batch_size": 4, "ppo_epochs": 2},
        "parallel": {"dp_shard": 2},
        "ray": {"include_dashboard": False},
        "tracking": {"backends": ["jsonl"]},
        "eval": {"files": [files["test"]], "reward": "arith", "limit": 8, "max_new_tokens": 6},
    }


@pytest.mark.quick
def test_gpu_shards_are_read_in_place_only_by_engines_that_see_their_gpus():
    """CUDA IPC opens an allocation only on a GPU the reading process sees: colocated engines
    read in place; an engine on a GPU of its own, or one that sees only one rank's, does not."""
    ranks = [_Host("node", ("0",), 0, 0), _Host("node", ("1",), 0, 0)]
    assert _gpus_unseen(ranks, [_Host("node", ("0", "1"), 0, 0)]) == ""
    unseen = "reads in place only shards on GPUs it sees"
    assert unseen in _gpus_unseen(ranks, [_Host("node", ("0",), 0, 0), _Host("node", ("1",), 0, 0)])
    assert unseen in _gpus_unseen(ranks[:1], [_Host("node", ("2",), 0, 0)])


@pytest.mark.quick
def test_buckets_keep_decoder_blocks_whole():
    sizes = {"model.embed_tokens.weight": 40, "model.layers.0.q.weight": 10, "model.layers.0.k.weight": 10,
             "model.layers.1.q.weight": 10, "model.layers.1.k.weight": 10, "model.norm.weight": 1}
    assert plan_buckets(sizes, 25) == [["model.embed_tokens.weight"],
                                       ["model.layers.0.q.weight", "model.layers.0.k.weight"],
                                       ["model.layers.1.q.weight", "model.layers.1.k.weight", "model.norm.weight"]]


@pytest.mark.quick
def test_shards_of_uneven_and_whole_tensors_reassemble():
    """Rank shards (uneven rows, a column split, bf16, a tensor sent whole by one rank)
    come back as the full tensors, through the same buffers the object store carries."""
    from rlsys.sync.shards import Assembler, pack, shard_pieces

    weight, head, norm = torch.randn(5, 3), torch.randn(3, 5).to(torch.bfloat16), torch.randn(3)
    rank0 = pack([("head", head[:, :2], (3, 5), (0, 0)), ("w", weight[:3], (5, 3), (0, 0)), ("norm", norm, (3,), (0,))])
    rank1 = pack([("w", weight[3:], (5, 3), (3, 0)), ("head", head[:, 2:], (3, 5), (0, 2))])
    assemble = Assembler()
    for _ in range(2):  # the staging buffer is reused
        full = assemble(shard_pieces([rank0, None, rank1]))
        assert list(full) == ["head", "w", "norm"]  # 30 bytes of bf16 before fp32: staged aligned
        assert torch.equal(full["w"], weight) and torch.equal(full["head"], head) and torch.equal(full["norm"], norm)


# the 8-rank pp2 x fsdp2 x tp2 and plain tp2 passed too when measured; left out for the suite's time
@pytest.mark.parametrize("layout", [["parallel.tp=2", "parallel.sequence_parallel=true", "rollout.num_engines=2",
                                     "rollout.sync_mode=object_store"],
                                    ["parallel.dp_shard=1", "parallel.pp=2", "parallel.tp=2"],
                                    ["rollout.tensor_parallel_size=2", "rollout.temperature=0.7"],
                                    ["rollout.sync_mode=gathered", "rollout.num_engines=2"],
                                    ["parallel.dp_shard=4", "rollout.sync_mode=gathered", "rollout.num_engines=4"]],
                         ids=["fsdp2xtp2-sp-object-store-then-gathered", "pp2xtp2",
                              "fsdp2-to-rollout-tp2-temperature0.7", "fsdp2-gathered-by-an-engine-per-rank",
                              "fsdp4-gathered-by-an-engine-per-rank"])
def test_vllm_logprobs_match_trainer_after_sync(ray_cluster, rl_config, layout):
    """Perturb the sharded policy, free an engine's weights as a step does, sync the policy from
    its training layout into vLLM's (one or two engines, or one engine of 2 tensor-parallel worker
    processes on CPU): read in place from the ranks' shared memory; bucket by bucket through the
    object store; or gathered bucket by bucket by the ranks, each engine reading from the rank
    beside it alone (a GPU's condition: on 2 and 4 FSDP ranks, one all-gather a bucket; on 4 ranks of
    fsdp2 x tp2, tensor by tensor, two of the ranks only gathering). vLLM's
    per-token log-probs equal the trainer's within 1e-4 (and differ before), after a second
    perturbation and sync too, at temperature 0.7 too (the engine's processed log-probs against the
    trainer's at the sampling temperature). (The plain fsdp2 layout's syncs to one engine are
    checked by the uninterrupted run's `rollout/logprob_abs_diff`.)"""
    cfg = rl_config(*layout)
    mode = next((item.split("=")[1] for item in layout if item.startswith("rollout.sync_mode=")), "shared")
    trainer = RLVRTrainer(cfg)
    try:
        queues = set().union(*trainer.rollout_group.on_each(probes.shared_memory_queues))
        if mode == "object_store":
            assert trainer.sync._can_share() and not trainer.sync.in_place
            _assert_too_few_file_descriptors_keep_shards_private(trainer)
        _assert_syncs_give_the_trainers_logprobs(trainer, trainer.sync, mode, cfg.seed)
        if mode == "object_store":  # the same groups, gathered
            engines = trainer.rollout_group
            gathered = WeightSync(trainer.train_group, engines, cfg.rollout.sync_bucket_mb, "gathered",
                                  [engines.placement.ranks_beside(i) for i in range(len(engines.actors))])
            _assert_syncs_give_the_trainers_logprobs(trainer, gathered, "gathered", cfg.seed + 2)
    finally:
        trainer.shutdown()
    # a tensor-parallel engine's shared-memory queues are gone with it (a killed actor left them)
    assert "rollout.tensor_parallel_size=2" not in layout or queues
    assert not any(os.path.exists(queue) for queue in queues), queues


def _assert_syncs_give_the_trainers_logprobs(trainer: RLVRTrainer, sync, mode: str, seed: int) -> None:
    """Two perturbations of the policy, each followed by a sync in `mode` after engine 0 freed its
    weights: the engines' log-probs differ from the trainer's before it and match after (1e-4). A
    gathered sync's engines each mapped the staging buffers of the rank beside them alone."""
    assert sync.mode == mode
    trainer.train_group.on_each(probes.perturb_parameters, 0.05, seed)
    for _ in range(2):  # vLLM's loaders place the first sync; the second replays their copies
        assert logprob_gap(trainer) > 1e-2
        # as in a step: the colocated engine frees its weights for the update
        freed = ray.get(trainer.rollout_group.actors[0].release_memory.remote())
        assert freed >= sync.total_bytes or torch.cuda.is_available()  # vLLM logs it on GPU
        stats = sync.run()
        assert logprob_gap(trainer) < 1e-4
        assert (stats["sync/in_place"], stats["sync/gathered"]) == (mode == "shared", mode == "gathered")
        if mode != "shared":
            assert stats["sync/buckets"] > 2  # streamed, not one whole-model transfer
        trainer.train_group.on_each(probes.perturb_parameters, 0.05, seed + 1)
    if mode == "gathered":
        engines = len(trainer.rollout_group.actors)
        assert sync.engine_ranks == [(engine,) for engine in range(engines)]
        pids = trainer.train_group.on_each(lambda rank: os.getpid())
        assert [sync.gather_handles[rank][0].pid for rank in sorted(sync.gather_handles)] == pids[:engines]


def logprob_gap(trainer: RLVRTrainer) -> float:
    """The largest gap between vLLM's log-probs of 2 samples of each of 8 prompts and the trainer's."""
    prompts = [(i, trainer.prompts[i].ids, {}) for i in range(8)]
    sampling = trainer.rollout_group.sampling(max_new_tokens=6)
    samples, _ = trainer.rollout_group.rollout(prompts, "single_turn", 2, sampling, seed=1)
    batch = collate_rollouts([s.prompt_ids for s in samples], [s.response_ids for s in samples],
                             trainer.tokenizer.pad_token_id)
    ours = trainer.rl_step.passes.policy(batch)[0]
    return max((ours[row, len(s.prompt_ids):len(s.prompt_ids) + len(s.response_ids)]
                - torch.tensor(s.logprobs)).abs().max().item() for row, s in enumerate(samples))


def _assert_too_few_file_descriptors_keep_shards_private(trainer) -> None:
    """A rank whose `ulimit -n` leaves fewer descriptors free than its shards take (plus a
    margin) is not asked to share them: the sync goes through the object store."""
    def set_soft_limit(actor, soft: int | None) -> int:
        old, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft or len(os.listdir("/proc/self/fd")) + 64, hard))
        return old

    rank = trainer.train_group.actors[-1]
    old = ray.get(rank.__ray_call__.remote(set_soft_limit, None))
    try:
        assert not trainer.sync._can_share()
    finally:
        ray.get(rank.__ray_call__.remote(set_soft_limit, old))


@pytest.fixture(scope="module")
def straight_rl(ray_cluster, tiny_model_dir, arith_files, tmp_path_factory):
    """4 uninterrupted steps, checkpointing at steps 2 and 4, with KL in the loss and in the reward."""
    out = str(tmp_path_factory.mktemp("rl_straight") / "run")
    raw = rl_raw(tiny_model_dir, arith_files, out)
    raw["tracking"].update(backends=["jsonl", "wandb", "tensorboard", "mlflow", "ray"], tags=["grpo", "tiny"],
                           group="tests", wandb_mode="offline")
    # the KL penalty in the reward too, with an adaptive coefficient (driver state a resume restores)
    raw["algorithm"].update(use_kl_in_reward=True, kl_ctrl={"type": "adaptive", "kl_coef": 0.05, "horizon": 32})
    cfg = build_config(RLJobConfig, raw)
    return cfg, run_rlvr(cfg)


def metrics(output_dir: str) -> dict[int, dict]:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return {row["step"]: row for row in map(json.loads, f)}


PHASES = ("generate", "reward", "old_logprob", "reference", "update", "sync")


def test_rlvr_logs_every_phase_and_exports(straight_rl):
    cfg, summary = straight_rl
    rows = metrics(cfg.output_dir)
    assert list(rows) == [0, 1, 2, 3, 4] and "val/accuracy" in rows[0] and "val/accuracy" in rows[4]
    for name in ["reward/mean", "reward/std", "reward/accuracy", "reward/errors", "response/length_mean",
                 "actor/kl", "actor/clip_frac", "actor/entropy", "actor/grad_norm", "rollout/logprob_abs_diff",
                 "mismatch/kl_k1", "mismatch/kl_k3", "mismatch/abs_log_ratio_p99", "mismatch/abs_log_ratio_max",
                 "mismatch/ratio_outside_2x_frac", "throughput/tokens_per_s", "sync/time_s", "perf/max_memory_resident_gib"] + \
            [f"time/{p}_s" for p in PHASES]:
        assert name in rows[1], name
    # the engines hold the trainer's weights: after the first sync (vLLM's loaders) and the later ones (replayed)
    assert all(rows[step]["rollout/logprob_abs_diff"] < 1e-4 for step in range(1, 5))
    assert 0.1 < rows[1]["perf/max_memory_resident_gib"] < 8  # a rank's process: torch, the tiny model, a step
    # step 1 samples the reference policy itself: KL 0, so the adaptive coefficient falls by the
    # clipped 20% x 32 responses / horizon 32
    assert rows[1]["actor/reward_kl_penalty"] == 0.0 and rows[1]["actor/reward_kl_penalty_coeff"] == 0.05
    assert rows[2]["actor/reward_kl_penalty_coeff"] == pytest.approx(0.04)
    assert os.path.isfile(os.path.join(summary["hf_model"], "model.safetensors"))
    assert summary["val_accuracy_before"] == rows[0]["val/accuracy"]


def wandb_records(path: str) -> list:
    """The records of an offline .wandb file (LevelDB log format: 32 KiB blocks of records with a
    7-byte header; wandb has no Python reader any more)."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, pending, records = 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return records


def wandb_history(records: list) -> list[set[str]]:
    """The metric names of each history record."""
    return [{item.key or "/".join(item.nested_key) for item in record.history.item}
            for record in records if record.WhichOneof("record_type") == "history"]


def test_trackers_get_the_same_metric_names(straight_rl):
    """wandb (offline), tensorboard and mlflow hold exactly the metric names of metrics.jsonl; the
    wandb run has the tags, group and resolved config the job set."""
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg, _ = straight_rl
    expected = {name for row in metrics(cfg.output_dir).values() for name, value in row.items()
                if name != "step" and value is not None}
    [wandb_file] = glob.glob(os.path.join(cfg.output_dir, "wandb", "offline-run-*", "run-*.wandb"))
    records = wandb_records(wandb_file)
    history = wandb_history(records)
    assert len(history) == cfg.train.steps + 1
    [run] = [record.run for record in records if record.WhichOneof("record_type") == "run"]
    assert list(run.tags) == ["grpo", "tiny"] and run.run_group == "tests"
    settings = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert settings["algorithm"]["kl_ctrl"]["horizon"] == 32
    names = {name for name in set().union(*history) if not name.startswith("samples/")}  # the Table's fields
    assert names - {"_step", "_runtime", "_timestamp"} == expected
    events = EventAccumulator(os.path.join(cfg.output_dir, "tensorboard")).Reload()
    assert set(events.Tags()["scalars"]) == expected
    with open(os.path.join(cfg.output_dir, "mlflow_run_id")) as f:
        run_id = f.read()
    client = MlflowClient(f"sqlite:///{os.path.abspath(cfg.output_dir)}/mlflow.db")
    assert set(client.get_run(run_id).data.metrics) == expected
    assert len(client.get_metric_history(run_id, "reward/mean")) == cfg.train.steps


def test_what_the_model_said_reaches_every_tracker_with_its_terms(straight_rl):
    """At each validation step (2 and 4) the step's first 8 responses, each with its prompt, its reward as
    the sum of its weighted terms and its group's advantage, go to samples.jsonl, a wandb Table,
    TensorBoard's text, an mlflow table and the report."""
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg, _ = straight_rl
    with open(os.path.join(cfg.output_dir, "samples.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == [2] * 8 + [4] * 8
    for r in records:
        assert r["prompt"].startswith("<|user|>") and 1 <= r["length"] <= cfg.rollout.max_new_tokens
        assert r["reward"] == pytest.approx(r["terms"]["arith"] + 0.5 * r["terms"]["flaky_reward.compute_score"])
    for start in range(0, len(records), cfg.rollout.n):  # the first two groups of each step, whole
        group = records[start:start + cfg.rollout.n]
        assert len({r["group"] for r in group}) == 1
        best, worst = max(group, key=lambda r: r["reward"]), min(group, key=lambda r: r["reward"])
        if best["reward"] > worst["reward"]:
            assert best["advantage"] > 0 > worst["advantage"]
    [table_dir] = glob.glob(os.path.join(cfg.output_dir, "wandb", "offline-run-*", "files", "media", "table"))
    tables = [json.load(open(os.path.join(table_dir, name))) for name in sorted(os.listdir(table_dir))]
    assert [len(t["data"]) for t in tables] == [8, 8] and {"prompt", "response", "reward/arith"} <= set(
        tables[0]["columns"])
    events = EventAccumulator(os.path.join(cfg.output_dir, "tensorboard")).Reload()
    assert [event.step for event in events.Tensors("samples/text_summary")] == [2, 4]
    with open(os.path.join(cfg.output_dir, "mlflow_run_id")) as f:
        run_id = f.read()
    client = MlflowClient(f"sqlite:///{os.path.abspath(cfg.output_dir)}/mlflow.db")
    assert [a.path for a in client.list_artifacts(run_id, "samples")] == ["samples/step_000002.json",
                                                                          "samples/step_000004.json"]
    with open(os.path.join(cfg.output_dir, "report.html")) as f:
        assert "samples at step 4" in f.read()


def test_the_timeline_holds_every_actor_on_the_drivers_clock(straight_rl):
    """trace.json holds the driver's steps and phases, each rank's forward, backward and optimizer steps
    and its calls, each engine's and reward worker's calls; each rank's update calls of step 3 lie within
    the driver's update phase of step 3, and its own forward spans within those calls (to 10 ms)."""
    cfg, _ = straight_rl
    with open(os.path.join(cfg.output_dir, "trace.json")) as f:
        events = json.load(f)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    spans: dict[str, list[dict]] = {}
    for event in events:
        if event["ph"] == "X":
            spans.setdefault(names[event["pid"]], []).append(event)
    ranks = ["rlsys/train/0", "rlsys/train/1"]
    assert {"driver", *ranks, "rlsys/rollout/0"} <= set(spans) and any(n.startswith("rlsys/reward/") for n in spans)
    driver = spans["driver"]
    assert [e["name"] for e in driver if e["name"].startswith("rlvr step")] == [f"rlvr step {s}" for s in range(1, 5)]
    assert "rlvr step 3: generate: rollout" in {e["name"] for e in spans["rlsys/rollout/0"]}

    def within(inner: dict, outer: dict) -> bool:
        return outer["ts"] - 10_000 <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + 10_000

    [step] = [e for e in driver if e["name"] == "rlvr step 3"]
    [update] = [e for e in driver if e["name"] == "update" and within(e, step)]
    for rank in ranks:
        assert {"forward", "backward", "optimizer_step"} <= {e["name"] for e in spans[rank]}
        calls = [e for e in spans[rank] if e["name"] == "rlvr step 3: update: train_step"]
        assert len(calls) == 4 and all(within(call, update) for call in calls)  # 2 mini-batches x 2 epochs
        forwards = [e for e in spans[rank] if e["name"] == "forward" and within(e, update)]
        assert forwards and all(any(within(f, call) for call in calls) for f in forwards)


def test_a_reward_hack_shows_in_the_samples(ray_cluster, tiny_model_dir, arith_files, tmp_path):
    """A reward term that pays for a marker (a digit anywhere in the response) beside the verifier: GRPO
    learns to write digits, and samples.jsonl shows the hack: the marker term paying on exactly the
    responses that hold a digit, and more responses it pays while the verifier pays nothing at the last
    step than at the first."""
    raw = rl_raw(tiny_model_dir, arith_files, str(tmp_path / "run"))
    raw["reward"]["terms"] = [{"name": "arith"}, {"path": MARKER}]
    raw["algorithm"] = {"kl_coef": 0.0}
    raw["optim"]["lr"] = 1e-2
    raw["train"].update(steps=4, save_every=0, val_every=0)
    raw["tracking"].update(log_samples_every=1, samples_per_log=32)
    raw.pop("eval")
    run_rlvr(build_config(RLJobConfig, raw))
    with open(os.path.join(raw["output_dir"], "samples.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert len(records) == 4 * 32
    marker = "marker_reward.compute_score"
    for r in records:
        assert r["terms"][marker] == any(c.isdigit() for c in r["scored_text"])
    hacks = [sum(r["terms"][marker] == 1 and r["terms"]["arith"] == 0 for r in records if r["step"] == step)
             for step in range(1, 5)]
    assert hacks[-1] > hacks[0], hacks


@pytest.mark.quick
def test_wandb_goes_online_only_with_an_api_key_unless_told(tmp_path):
    """tracking.wandb_mode auto: WANDB_MODE when set; else online with WANDB_API_KEY or `wandb login`'s
    netrc entry for the wandb host (WANDB_BASE_URL's), offline without."""
    from rlsys.tracking.tracker import wandb_mode

    netrc_file = tmp_path / "netrc"
    netrc_file.write_text("machine api.wandb.ai\n  login user\n  password 0123456789abcdef\n")
    netrc_file.chmod(0o600)
    home = {"HOME": str(tmp_path / "nobody")}
    assert wandb_mode("auto", home) == "offline"
    assert wandb_mode("auto", home | {"WANDB_API_KEY": "0123"}) == "online"
    assert wandb_mode("auto", home | {"NETRC": str(netrc_file)}) == "online"
    assert wandb_mode("auto", home | {"NETRC": str(netrc_file), "WANDB_BASE_URL": "https://wandb.example.com"}) == \
        "offline"
    assert wandb_mode("auto", home | {"WANDB_API_KEY": "0123", "WANDB_MODE": "disabled"}) == "disabled"
    assert wandb_mode("offline", home | {"WANDB_API_KEY": "0123"}) == "offline"
    assert wandb_mode("online", home) == "online"


def test_rlvr_writes_a_report(straight_rl):
    cfg, _ = straight_rl
    assert os.path.getsize(os.path.join(cfg.output_dir, "report.png")) > 10_000
    with open(os.path.join(cfg.output_dir, "report.html")) as f:
        page = f.read()
    assert "data:image/png;base64," in page and "val_accuracy_after" in page and "timeline of rlvr step 4" in page


def sampled_batch(trainer: RLVRTrainer) -> dict[str, torch.Tensor]:
    """2 responses to each of the first 8 prompts, from the trainer's engines, collated."""
    samples, _ = trainer.rollout_group.rollout([(i, trainer.prompts[i].ids, {}) for i in range(8)], "single_turn", 2,
                                         trainer.rollout_group.sampling(temperature=1.0, max_new_tokens=6), seed=3)
    return collate_rollouts([s.prompt_ids for s in samples], [s.response_ids for s in samples],
                            trainer.tokenizer.pad_token_id)


def engine_length(trainer: RLVRTrainer) -> int:
    return trainer.rollout_group.on_each(lambda worker: worker.llm.llm_engine.model_config.max_model_len)[0]


def test_update_moves_log_probs_along_the_advantages(ray_cluster, rl_config):
    """One policy update raises the log-prob of positive-advantage responses
    and lowers it for negative ones: the reward signal reaches the policy. The engine is built for
    the run's longest sequence (training or validation prompt, plus the response budget), not the
    model's context."""
    cfg = rl_config("algorithm.kl_coef=0", "algorithm.ppo_mini_batch_size=0", "algorithm.ppo_epochs=1",
                    "optim.lr=1e-3", "optim.max_grad_norm=0")
    trainer = RLVRTrainer(cfg)
    try:
        longest = max(len(p.ids) for p in [*trainer.prompts, *trainer.evaluator.prompts])
        assert engine_length(trainer) == longest + cfg.rollout.response_budget < 256
        batch = sampled_batch(trainer)
        advantages = torch.tensor([1.0, -1.0] * 8)
        old = trainer.rl_step.passes.policy(batch)[0]
        trainer.rl_step.update.run(RLBatch(None, [], None, batch, None, old_logprobs=old,
                                           advantages=advantages.unsqueeze(1) * batch["loss_mask"]), step=1)
        change = ((trainer.rl_step.passes.policy(batch)[0] - old) * batch["loss_mask"]).sum(1)
    finally:
        trainer.shutdown()
    up, down = change[advantages > 0], change[advantages < 0]
    assert up.mean() > 0 > down.mean(), (up, down)
    # responses shared across rows can pull some rows the other way, but not most
    assert (up > 0).float().mean() >= 0.75 and (down < 0).float().mean() >= 0.75, (up, down)


def test_a_trainer_takes_the_ranks_and_engine_the_last_one_kept_and_steps_alike(ray_cluster, rl_config):
    """With actors kept between groups (`rlsys.actors.kept_actors`, on in this suite), a trainer built
    after another of the same placement runs on the same rank and engine processes (each built again in
    them), and its first step logs what the first trainer's first step logged. The first trainer ends
    with a generation in flight (an asynchronous run's, at a restart), held mid-response as a sync holds
    the engine: the kept engine fails it, ends its serving before its vLLM engine shuts down (which
    tears down vLLM's process-wide state that the next engine sets up), and the next engine samples."""
    from rlsys.actors import kept_actors

    cfg = rl_config("eval=null", f"rollout.max_model_len={LONG_RESPONSE + 64}")
    kept_actors.retire()  # the first trainer starts new processes
    pids, steps = [], []
    for _ in range(2):
        trainer = RLVRTrainer(cfg)
        try:
            pids.append([group.on_each(lambda actor: os.getpid()) for group in (trainer.train_group,
                                                                                 trainer.rollout_group)])
            steps.append(trainer.step(1))
            if len(steps) == 1:
                in_flight = _hold_a_generation_in_flight(trainer)
        finally:
            trainer.shutdown()
    with pytest.raises(ray.exceptions.RayTaskError, match="this engine was released"):
        ray.get(in_flight)
    assert pids[0] == pids[1]
    figures = ("reward/mean", "response/length_mean", "actor/pg_loss", "actor/kl", "actor/entropy", "actor/grad_norm",
               "rollout/logprob_abs_diff", "mismatch/kl_k3")
    first, second = ({name: step[name] for name in figures} for step in steps)
    assert second == first


LONG_RESPONSE = 120
"""Tokens of the generation `_hold_a_generation_in_flight` leaves running: far more than one engine step."""


def _hold_a_generation_in_flight(trainer: RLVRTrainer):
    """Start long responses to 4 prompts; once the engine has stepped on them, hold its steps as a
    sync's first bucket does (`RequestEngine.sync_turn`), so they stay in flight. Their result's ref."""
    prompts = [(i, trainer.prompts[i].ids, trainer.prompts[i].row) for i in range(4)]
    stepped = trainer.rollout_group.on_each(lambda worker: worker.engine.step_s)[0]
    ref = trainer.rollout_group.submit(0, RolloutWorker.rollout, prompts, "single_turn", 2,
                                       trainer.rollout_group.sampling(max_new_tokens=LONG_RESPONSE), 7)
    deadline = time.monotonic() + 300
    while trainer.rollout_group.on_each(lambda worker: worker.engine.step_s)[0] == stepped:
        assert time.monotonic() < deadline, "the engine took no step"
        time.sleep(0.01)
    trainer.rollout_group.on_each(lambda worker: setattr(worker.engine, "_syncing", True))
    assert trainer.rollout_group.on_each(lambda worker: worker.engine.busy)[0], "the responses ended in one step"
    return ref


# fsdp2 alone, pp=2 and cp=2 passed too when measured; they are left out for the suite's time
# (tp2-sp runs FSDP2 as well, over a data-parallel mesh of one)
@pytest.mark.parametrize("layout", [["parallel.dp_shard=1", "parallel.tp=2", "parallel.sequence_parallel=true"]],
                         ids=["tp2-sp"])
def test_critic_value_loss_falls_and_resumes(ray_cluster, rl_config, tmp_path, layout):
    """PPO's critic (value head on the policy's backbone, zero at the start): its clipped value
    loss falls over updates on one fixed batch, and a checkpoint restores its values."""
    from rlsys.algorithms.advantages import AdvantageInputs, gae_advantages_and_returns
    from rlsys.algorithms.value_loss import value_loss
    from rlsys.data.batching import num_targets, on_last_response_token
    from rlsys.stages.checkpoints import CheckpointDir, restore_training_state, save_training_state

    cfg = rl_config("algorithm.adv_estimator=gae", "critic.optim.lr=1e-3", "critic.cliprange_value=10", *layout)
    trainer = RLVRTrainer(cfg)
    try:
        batch = sampled_batch(trainer)

        def values() -> torch.Tensor:
            shards = trainer.train_group.run_data_parallel(TrainWorker.forward, batch, loss_fn=token_values,
                                                           role="critic")
            return torch.cat([out["values"] for out, _ in shards])

        batch["values"] = values()
        assert batch["values"].abs().max() == 0  # the value head starts at zero
        scores = torch.tensor([1.0, 0.0] * 8)
        inputs = AdvantageInputs(on_last_response_token(scores, batch), batch["loss_mask"],
                                 torch.arange(16) // 2, batch["values"])
        _, batch["returns"] = gae_advantages_and_returns(inputs, gamma=1.0, lam=0.95)
        loss_fn = value_loss({"tokens": num_targets(batch), "sequences": 16}, 10.0, "token-mean")
        critic_step = lambda: trainer.train_group.run_data_parallel(TrainWorker.critic_step, batch,  # noqa: E731
                                                                    loss_fn=loss_fn)[0]
        losses = [critic_step()["critic/vf_loss"] for _ in range(6)]
        checkpoints = CheckpointDir(str(tmp_path / "ckpt"), keep_last=1)
        save_training_state(checkpoints, 1, trainer.train_group, trainer.sampler)
        saved = values()
        trainer.train_group.run_data_parallel(TrainWorker.critic_step, batch, loss_fn=loss_fn)
        assert not torch.allclose(values(), saved)
        restore_training_state(checkpoints, trainer.train_group, trainer.sampler)
        assert torch.allclose(values(), saved, atol=1e-6)
    finally:
        trainer.shutdown()
    assert losses[0] == pytest.approx(0.5 * (batch["returns"] ** 2).sum().item() / num_targets(batch), rel=1e-4)
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.6 * losses[0], losses


def test_dynamic_sampling_trains_only_on_groups_of_mixed_rewards(ray_cluster, rl_config):
    """With a coin-flip reward, each 2-response group is uniform half the time: DAPO's dynamic
    sampling draws prompt batches until all 8 groups of the step have mixed rewards."""
    from rlsys.actors.phases import PhaseTimer

    cfg = rl_config("algorithm.filter_groups=true", "rollout.n=2", f"reward.terms=[{{path: {COIN}}}]",
                    "reward.overlong_buffer_len=2", "reward.overlong_penalty_factor=0.5")
    trainer = RLVRTrainer(cfg)
    try:
        rollout = trainer.rl_step.rollout.collect(1, PhaseTimer("rlvr", 1))
        samples, groups, scored, rewards, metrics = (rollout.episodes, rollout.groups, rollout.scored, rollout.rewards,
                                                     rollout.metrics)
    finally:
        trainer.shutdown()
    assert len(samples) == len(scored) == 16 and metrics["dapo/mixed_groups"] == 1.0
    assert groups.tolist() == [g for g in range(8) for _ in range(2)]
    scores = torch.tensor([s.score for s in scored])
    assert (scores.view(8, 2)[:, 0] != scores.view(8, 2)[:, 1]).all()
    assert [s.prompt_index for s in samples[::2]] == [s.prompt_index for s in samples[1::2]]
    # DAPO's overlong shaping: responses of 5 and 6 tokens (budget 6, buffer 2) lose 0.25 and 0.5
    lengths = torch.tensor([len(s.response_ids) for s in samples])
    expected = scores - 0.5 * ((lengths - 4).clamp(min=0) / 2)
    assert torch.allclose(rewards, expected) and metrics["reward/overlong_penalty"] < 0


def test_restart_after_a_dead_rank_reproduces_the_metrics(straight_rl, tmp_path, monkeypatch):
    """train.max_restarts=1: a training rank killed after step 3 (the newest checkpoint: step 2's)
    costs one restart inside the same run, which restores the step-2 checkpoint as a resumed run
    does (`RLVRSession.resume`), the adaptive KL coefficient in the reward included, and steps 3-4
    match the uninterrupted run's."""
    from faults import signal_after_steps

    cfg, _ = straight_rl
    cfg = replace(cfg, output_dir=str(tmp_path / "restarted"), train=replace(cfg.train, max_restarts=1),
                  tracking=TrackingConfig(backends=["jsonl"]))
    pending = signal_after_steps(monkeypatch, cfg.output_dir, {3: [("train-1", signal.SIGKILL)]})
    summary = run_rlvr(cfg)
    assert not pending
    expected, got = metrics(straight_rl[0].output_dir), metrics(cfg.output_dir)
    assert summary["restarts"] == 1 and summary["resumed_from_step"] == 2
    assert got[4]["restarts"] == 1 and got[2]["restarts"] == 0
    assert list(got) == [0, 1, 2, 3, 4]
    for step in (3, 4):
        for name in ("reward/mean", "actor/pg_loss", "actor/kl", "actor/entropy", "response/length_mean",
                     "actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff", "val/accuracy"):
            assert got[step].get(name) == pytest.approx(expected[step].get(name), abs=1e-5), (step, name)


def test_an_openai_client_harness_is_trained_on_and_its_failures_are_dropped(ray_cluster, rl_config):
    """`rollout.agent_loop: openai`: the harness (tests/assets/openai_harness.py) answers through the
    engine's endpoint; what it recorded is what the trainer computes log-probs of (the engine's equal
    the trainer's), every segment of an episode whose history it rewrote included, and the prompts
    it fails on are left out of the step and counted."""
    harness = os.path.join(os.path.dirname(__file__), "assets", "openai_harness.py")
    cfg = rl_config("rollout.agent_loop=openai", f"rollout.agent_entry={harness}:run", "rollout.agent_timeout_s=30",
                    "eval=null", "algorithm.kl_coef=0", "reward.terms=[{name: arith}]")
    trainer = RLVRTrainer(cfg)
    try:
        assert engine_length(trainer) == 256  # a harness writes the requests: the model's context
        remainders = [sum(map(ord, trainer.prompts[i].messages[-1]["content"])) % 4
                      for i in copy.deepcopy(trainer.sampler).next_indices()]
        step = trainer.step(1)
    finally:
        trainer.shutdown()
    failing, rewritten = remainders.count(0), remainders.count(1)
    assert 0 < failing < cfg.train.prompts_per_step and rewritten > 0
    assert step["agent/dropped_error"] == failing * cfg.rollout.n
    assert step["agent/prefix_breaks"] == rewritten * cfg.rollout.n
    episodes = len(remainders) - failing
    assert step["agent/segments_mean"] == pytest.approx((episodes + rewritten) / episodes)
    assert step["rollout/logprob_abs_diff"] < 1e-4 and step["actor/entropy"] > 0


def test_the_optimal_token_baseline_reads_the_policys_sum_of_squared_probabilities(ray_cluster, rl_config):
    """algorithm.adv_estimator: optimal_token_baseline takes the old log-probs and each position's
    sum of squared next-token probabilities from one trainer pass (across the data-parallel ranks:
    the model's own, within 1e-5), and a step trains on its advantages."""
    from transformers import AutoModelForCausalLM

    cfg = rl_config("algorithm.adv_estimator=optimal_token_baseline", "eval=null", "algorithm.kl_coef=0")
    trainer = RLVRTrainer(cfg)
    try:
        assert trainer.rl_step.passes.source == "trainer"
        prompts = [(i, trainer.prompts[i].ids, {}) for i in range(4)]
        samples, _ = trainer.rollout_group.rollout(prompts, "single_turn", 2, trainer.rollout_group.sampling(),
                                                   seed=1)
        batch = collate_rollouts([s.prompt_ids for s in samples], [s.response_ids for s in samples],
                                 trainer.tokenizer.pad_token_id)
        rows = trainer.rl_step.passes.rows(batch, logprobs_and_sum_pi_squared(cfg.rollout.temperature))
        step = trainer.step(1)
    finally:
        trainer.shutdown()
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    expected = torch.softmax(logits[:, :-1] / cfg.rollout.temperature, -1).square().sum(-1)
    real = batch["attention_mask"][:, 1:].bool()
    assert (rows["sum_pi_squared"][:, 1:][real] - expected[real]).abs().max() < 1e-5
    assert math.isfinite(step["actor/pg_loss"]) and step["actor/entropy"] > 0


def test_remax_in_bypass_mode_generates_and_scores_a_greedy_response_per_prompt(ray_cluster, rl_config):
    """algorithm.adv_estimator: remax: the step's rollout adds one greedy response per prompt, scored
    by the run's reward, whose scores are the step's baselines; VeRL's bypass_pg_is preset trains
    on them with the engine's log-probs as the old ones (no trainer pass) and importance weights."""
    cfg = rl_config("algorithm.adv_estimator=remax", "eval=null", "algorithm.kl_coef=0",
                    "algorithm.rollout_correction.preset=bypass_pg_is")
    trainer = RLVRTrainer(cfg)
    try:
        indices = copy.deepcopy(trainer.sampler).next_indices()
        step = trainer.step(1)
        baselines = dict(trainer.features.of_kind(ReMax).baselines)
    finally:
        trainer.shutdown()
    assert sorted(baselines) == sorted(indices) and set(baselines.values()) <= {0.0, 1.0}
    assert math.isfinite(step["actor/pg_loss"]) and "time/old_logprob_s" not in step
    assert 0 < step["rollout_corr/is_weight"] <= 2.0


def test_an_engine_that_cannot_start_says_why(ray_cluster, rl_config):
    """The error a rollout engine's constructor raised (here vLLM refusing an argument) is in the
    failure that reports its death (the CLI's one line), not only in the engine's log."""
    cfg = rl_config("rollout.engine_kwargs={no_such_arg: 1}", "eval=null", "parallel.dp_shard=1")  # one rank will do
    with pytest.raises(WorkerFailure, match=r"^rollout worker 0 \(rlsys/rollout/0\) died \(TypeError: EngineArgs"
                                            r"\.__init__\(\) got an unexpected keyword argument 'no_such_arg'\)"):
        RLVRTrainer(cfg)
