"""Every training layout gives the single-process loss, gradients and log-probs of the same
global batch: FSDP2, HSDP, tensor parallel with sequence and loss parallel, FSDP2 x TP (with
and without them), pipeline parallel (three schedules, and composed with FSDP2, with FSDP2 x
TP, and with context parallel and TP with sequence and loss parallel) and context parallel
with FSDP2, for the SFT loss and the RL policy loss with a KL term; long answers to shared
prompts attending span by span under FSDP2 x TP with sequence and loss parallel. Plain tp2, pp2 x tp2 and
cp2 passed too when measured; each is a part of a composition here, left out for the
suite's time."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
import worker_probes as probes
from parity import (
    ALGO,
    MICRO_BATCH,
    RL_INPUTS,
    assert_gradients_match,
    assert_layout_matches_single_process,
    long_answer_batch,
    parity_batches,
    reference_gradients,
    reference_logprobs,
    reference_model,
    trained_gradients,
)

from rlsys.actors.train_group import TrainGroup
from rlsys.actors.train_worker import TrainWorker, build_worker_spec
from rlsys.algorithms.actor_loss import actor_loss
from rlsys.algorithms.lm_loss import is_token_level, logprobs_of_labels, nll_loss, token_logprobs
from rlsys.data.batching import micro_batches, num_targets, split_rows, token_budget_sizes
from rlsys.data.packing import pack_rows, span_ancestors

# One xdist worker runs this module (scripts/test.sh): the parity batches and the 4-layer model, built once.
pytestmark = pytest.mark.xdist_group("parallel_grads")

LAYOUTS = {  # name: overrides; by world size, so that a layout's group takes the ranks the last one kept
    "fsdp2": ["parallel.dp_shard=2"],
    "tp2-sp-lp": ["parallel.dp_shard=1", "parallel.tp=2", "parallel.sequence_parallel=true",
                  "parallel.loss_parallel=true"],
    # unpacked rows under sequence parallel: each row a span of its own (`SharedPrefixSpans.of_rows`)
    "tp2-sp-unpacked": ["parallel.dp_shard=1", "parallel.tp=2", "parallel.sequence_parallel=true",
                        "parallel.pack_sequences=false"],
    "pp2-gpipe": ["parallel.dp_shard=1", "parallel.pp=2", "parallel.pp_schedule=gpipe"],
    "pp2-1f1b": ["parallel.dp_shard=1", "parallel.pp=2", "parallel.pp_schedule=1f1b"],
    "pp2-interleaved": ["parallel.dp_shard=1", "parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b"],
    "hsdp": ["parallel.dp_replicate=2"],  # x dp_shard=2: 4 ranks
    "fsdp2xtp2": ["parallel.dp_shard=2", "parallel.tp=2"],
    "fsdp2xtp2-sp-lp": ["parallel.dp_shard=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                        "parallel.loss_parallel=true"],
    "cp2xfsdp2": ["parallel.cp=2", "parallel.dp_shard=2"],
    # pp2 x fsdp2 alone passed too; pp2 x fsdp2 x tp2 composes the same and more, so it stands in for the suite's time
    "pp2xfsdp2xtp2": ["parallel.pp=2", "parallel.dp_shard=2", "parallel.tp=2", "parallel.pp_microbatches=2"],
    # every composition with context parallel, and pipelining with sequence and loss parallel, in one layout
    "pp2xcp2xtp2-sp-lp": ["parallel.dp_shard=1", "parallel.pp=2", "parallel.cp=2", "parallel.tp=2",
                          "parallel.sequence_parallel=true", "parallel.loss_parallel=true",
                          "parallel.pp_microbatches=2"],
}


@pytest.fixture(scope="module")
def four_layer_model_dir(tmp_path_factory) -> str:
    """Pipeline layouts need a layer per stage (4 for interleaved 1F1B over 2 ranks), tp x cp
    a head (and a key/value head) per rank of the two."""
    from rlsys.models.tiny import TinyModelSpec, write_tiny_model

    spec = TinyModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=105)
    return write_tiny_model(str(tmp_path_factory.mktemp("tiny4")), spec)


@pytest.fixture(scope="module")
def batches(tiny_model_dir, arith_files):
    return parity_batches(tiny_model_dir, arith_files)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", [pytest.param(name, marks=pytest.mark.quick) if name == "fsdp2" else name
                                    for name in LAYOUTS])  # parity on 2 ranks in the quick tier
def test_layout_matches_single_process(ray_cluster, sft_config, tiny_model_dir, four_layer_model_dir, batches,
                                       layout):
    """The layout gives one process's SFT loss, gradients and log-probs and RL-loss gradients; on
    some layouts the same group then takes more batches (`MORE_CHECKS`)."""
    sft, rl, counts = batches
    model_dir = four_layer_model_dir if layout.startswith("pp") else tiny_model_dir
    cfg = sft_config(*LAYOUTS[layout], f"train.micro_batch_size={MICRO_BATCH}", f"model.path={model_dir}")
    checks = [check(model_dir, batches, cfg.parallel.cp) for check in MORE_CHECKS.get(layout, ())]
    sft_grads, local_shapes = assert_layout_matches_single_process(
        cfg, model_dir, sft, rl, counts, then=lambda group: [check(group) for check in checks])
    shards = cfg.parallel.dp_shard * cfg.parallel.cp * cfg.parallel.tp  # FSDP2 shards over dp_shard x cp
    q_rows = sft_grads["model.layers.0.self_attn.q_proj.weight"].shape[0]
    assert local_shapes[0]["model.layers.0.self_attn.q_proj.weight"][0] == q_rows // shards  # sharded, not copied


def test_a_group_of_the_same_shape_takes_the_ranks_the_last_one_kept(ray_cluster, sft_config, batches):
    """A training group that ends healthy leaves its ranks' processes to the next group of its shape
    (`rlsys.actors.kept_actors`, on in this suite): the next group's ranks are the same processes and
    give the SFT loss and gradients a group of new processes gives, bit for bit; a group that saw a
    rank die is not kept, and the next group starts processes of its own."""
    import ray

    from rlsys.actors import kept_actors
    from rlsys.actors.failures import WorkerFailure

    sft, _, _ = batches
    cfg = sft_config(f"train.micro_batch_size={MICRO_BATCH}")
    spec = build_worker_spec(cfg, MICRO_BATCH, cfg.train.steps)
    kept_actors.retire()  # the first group starts new processes
    pids, results = [], []
    for turn in range(3):
        group = TrainGroup(spec, cfg.ray)
        try:
            pids.append(group.on_each(lambda worker: os.getpid()))
            if turn < 2:
                results.append(trained_gradients(group, (sft, nll_loss(num_targets(sft))))[0])
            else:
                ray.kill(group.actors[1])
                wait_gone(pids[-1][1])  # ray.kill returns before the process ends: a call may still land
                with pytest.raises(WorkerFailure):
                    group.on_each(lambda worker: os.getpid())
        finally:
            group.shutdown()
    assert pids[0] == pids[1] == pids[2]
    (first_metrics, first_grads), (kept_metrics, kept_grads) = results
    assert kept_metrics == first_metrics and first_grads.keys() == kept_grads.keys()
    assert all(torch.equal(first_grads[name], kept_grads[name]) for name in first_grads)
    group = TrainGroup(spec, cfg.ray)
    try:
        assert not set(group.on_each(lambda worker: os.getpid())) & set(pids[0])
    finally:
        group.shutdown()


def wait_gone(pid: int, timeout_s: float = 120.0) -> None:
    """Until the process `pid` (on this machine) has ended."""
    import time

    deadline = time.monotonic() + timeout_s
    while os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z":
        assert time.monotonic() < deadline, f"process {pid} still runs {timeout_s:g} s after it was killed"
        time.sleep(0.1)


def long_answers_match_one_process(model_dir: str, batches, cp: int):
    """4 groups of 3 answers of 80 tokens to an 80-token prompt, two of them after a 20-token history
    (`long_answer_batch`): each micro-batch (a group) lays out its contexts as a tree and attends span
    by span. The layout (FSDP2 x TP with sequence and loss
    parallel; context parallel x FSDP2, Ulysses attending by the spans over the gathered sequence)
    gives one process's RL-loss gradients; without context parallel so does GSPO's sequence-level
    loss, which reads the packed forward's logits laid back
    out as rows. Returns the check of a group."""
    rl, counts = long_answer_batch(model_dir)
    for micro in micro_batches(rl, MICRO_BATCH):
        packed = pack_rows(micro).batch
        chains = span_ancestors(packed["segment_ids"], packed["prefix_ids"])
        assert max(map(len, chains)) == 2  # two answers continue the history, which continues the prompt
    losses = [actor_loss(counts, ALGO, RL_INPUTS)]
    if cp == 1:
        losses.append(actor_loss(counts, replace(ALGO, policy_loss="gspo"), RL_INPUTS))
        assert not is_token_level(losses[1])
    expected = [reference_gradients(model_dir, rl, loss)[1] for loss in losses]

    def check(group) -> None:
        for (_, got), want in zip(trained_gradients(group, *[(rl, loss) for loss in losses]), expected):
            assert_gradients_match(got, want)

    return check


def episodes_match_one_process(model_dir: str, batches, cp: int):
    """`episode_batch`'s policy-loss gradients on the layout equal one process's. Returns the check
    of a group."""
    batch, counts, algo = episode_batch(batches)
    _, expected = reference_gradients(model_dir, batch, actor_loss(counts, algo))

    def check(group) -> None:
        [(_, got)] = trained_gradients(group, (batch, actor_loss(counts, algo)))
        assert_gradients_match(got, expected)

    return check


MORE_CHECKS = {"fsdp2": [episodes_match_one_process],
               "fsdp2xtp2-sp-lp": [long_answers_match_one_process],
               "cp2xfsdp2": [long_answers_match_one_process]}
"""Layouts whose group takes more batches after the parity batches (same layout, no second group)."""


WINDOWED_LAYOUTS = {  # by world size, as LAYOUTS
    "tp2-sp-unpacked": LAYOUTS["tp2-sp-unpacked"],
    "pp2-1f1b": LAYOUTS["pp2-1f1b"],
    "cp2-unpacked": ["parallel.dp_shard=1", "parallel.cp=2", "parallel.pack_sequences=false"],
    "fsdp2xtp2-sp-lp": LAYOUTS["fsdp2xtp2-sp-lp"],
    "cp2xfsdp2": LAYOUTS["cp2xfsdp2"],
    "pp2xcp2": ["parallel.dp_shard=1", "parallel.pp=2", "parallel.cp=2"],
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", list(WINDOWED_LAYOUTS))
def test_a_sliding_window_model_matches_single_process(ray_cluster, sft_config, windowed_model_dir, layout):
    """A model whose second layer attends within 3 positions, on `long_answer_batch` (80-token
    prompts and answers, contexts packed as trees): sequence parallel (packed, and unpacked rows a
    span each), a pipeline (its stages' rows a span each) and context parallel (packed, and
    unpacked rows a span each over the gathered sequence, in a pipeline too) give one process's RL-loss gradients,
    which transformers' own sliding-window mask gives; every rank attends by spans
    (`attends_spans_where_it_can`)."""
    rl, counts = long_answer_batch(windowed_model_dir)
    loss = actor_loss(counts, ALGO, RL_INPUTS)
    _, expected = reference_gradients(windowed_model_dir, rl, loss)
    cfg = sft_config(*WINDOWED_LAYOUTS[layout], f"train.micro_batch_size={MICRO_BATCH}",
                     f"model.path={windowed_model_dir}")
    group = TrainGroup(build_worker_spec(cfg, MICRO_BATCH, cfg.train.steps), cfg.ray)
    try:
        assert all(group.on_each(probes.attends_spans_where_it_can))
        [(_, got)] = trained_gradients(group, (rl, loss))
    finally:
        group.shutdown()
    assert_gradients_match(got, expected)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("layout", "budget", "sft_passes"), [
    (["parallel.dp_shard=2"], 21, [3, 2]),
    # each context-parallel rank holds half of every sequence: a budget of 11 takes 22 tokens of sequences
    (["parallel.dp_shard=2", "parallel.cp=2"], 11, [2, 2]),
], ids=["fsdp2", "cp2xfsdp2"])
def test_token_budget_evens_the_micro_batches_of_the_ranks(ray_cluster, sft_config, tiny_model_dir, batches,
                                                           layout, budget, sft_passes):
    """Micro-batches cut by a token budget on 2 FSDP2 ranks: where one rank's shard needs fewer
    than the other's, it splits its own (the SFT batch on fsdp2) or, out of rows, runs a pass
    that adds nothing (3 RL rows: 2 on one rank, 1 on the other); the single-process gradients
    either way."""
    sft, rl, counts = batches
    cp = 2 if "parallel.cp=2" in layout else 1
    few = {k: v[3:6] for k, v in rl.items()}  # one prompt's 3 responses of 12 tokens: 2 passes against 1
    few_counts = {"tokens": num_targets(few), "sequences": 3}
    lengths = lambda shard: shard["attention_mask"].sum(1).tolist()  # noqa: E731
    assert [len(token_budget_sizes(lengths(s), budget * cp)) for s in split_rows(sft, 2)] == sft_passes
    assert [len(token_budget_sizes(lengths(s), budget * cp)) for s in split_rows(few, 2)] == [2, 1]
    _, sft_grads = reference_gradients(tiny_model_dir, sft, nll_loss(num_targets(sft)))
    _, few_grads = reference_gradients(tiny_model_dir, few, actor_loss(few_counts, ALGO, RL_INPUTS))

    cfg = sft_config(*layout, f"train.micro_batch_tokens={budget}")
    group = TrainGroup(build_worker_spec(cfg, cfg.train.micro_batch_size, cfg.train.steps), cfg.ray)
    try:
        (_, got_sft), (_, got_few) = trained_gradients(
            group, (sft, nll_loss(num_targets(sft))), (few, actor_loss(few_counts, ALGO, RL_INPUTS)))
        logprobs = torch.cat([out["logprobs"] for out, _ in group.run_data_parallel(TrainWorker.forward, few,
                                                                                    loss_fn=token_logprobs())])
    finally:
        group.shutdown()

    assert_gradients_match(got_sft, sft_grads)
    assert_gradients_match(got_few, few_grads)
    expected = reference_logprobs(tiny_model_dir, few) * few["attention_mask"]
    assert logprobs.shape == expected.shape and (logprobs * few["attention_mask"] - expected).abs().max() < 1e-5


@pytest.mark.timeout(600)
def test_token_budget_sets_the_pipeline_micro_batches(ray_cluster, sft_config, tiny_model_dir, batches):
    """Under pipeline parallel a token budget sets how many micro-batches the schedule runs: more
    than parallel.pp_microbatches (4) here, where the budget needs them; the single-process
    gradients and log-probs either way."""
    sft, rl, counts = batches
    budget = 21
    needed = len(token_budget_sizes(sft["attention_mask"].sum(1).tolist(), budget))
    assert needed > 4
    _, sft_grads = reference_gradients(tiny_model_dir, sft, nll_loss(num_targets(sft)))
    _, rl_grads = reference_gradients(tiny_model_dir, rl, actor_loss(counts, ALGO, RL_INPUTS))

    cfg = sft_config("parallel.dp_shard=1", "parallel.pp=2", f"train.micro_batch_tokens={budget}")
    group = TrainGroup(build_worker_spec(cfg, cfg.train.micro_batch_size, cfg.train.steps), cfg.ray)
    try:
        passes = group.on_each(probes.pipeline_micro_batches, sft)
        (_, got_sft), (_, got_rl) = trained_gradients(
            group, (sft, nll_loss(num_targets(sft))), (rl, actor_loss(counts, ALGO, RL_INPUTS)))
        logprobs = torch.cat([out["logprobs"] for out, _ in group.run_data_parallel(TrainWorker.forward, sft,
                                                                                    loss_fn=token_logprobs())])
    finally:
        group.shutdown()

    assert passes == [needed, needed]
    assert_gradients_match(got_sft, sft_grads)
    assert_gradients_match(got_rl, rl_grads)
    expected = reference_logprobs(tiny_model_dir, sft) * sft["attention_mask"]
    assert (logprobs * sft["attention_mask"] - expected).abs().max() < 1e-5


EPISODE_OF = torch.tensor([0, 0, 1, 2, 2, 3, 4, 4, 5, 6, 7, 7])
"""The episode of each of `episode_batch`'s 12 rows."""


def episode_batch(batches):
    """8 episodes in 4 GRPO groups, 4 of them of two segments (12 rows, the RL parity batch's
    tokens), each segment with its episode's GRPO advantage; the loss's counts and algorithm."""
    from rlsys.algorithms.advantages import AdvantageInputs, episode_advantages
    from rlsys.config.rl import AlgorithmConfig
    from rlsys.data.batching import on_last_response_token

    _, rl, _ = batches
    group_of_episode = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    last = torch.tensor([False, True, True, False, True, True, False, True, True, True, False, True])
    row_rewards = torch.zeros(12).masked_scatter(last, rewards)
    algo = AlgorithmConfig(adv_estimator="grpo")
    batch = {k: rl[k] for k in ("input_ids", "attention_mask", "loss_mask")}
    inputs = AdvantageInputs(on_last_response_token(row_rewards, batch), batch["loss_mask"],
                             group_of_episode[EPISODE_OF])
    batch["advantages"] = episode_advantages(inputs, EPISODE_OF, algo)
    return batch, {"tokens": num_targets(batch), "sequences": 12}, algo


@pytest.mark.quick
def test_episodes_of_several_segments_train_every_segment_with_the_episodes_advantage(tiny_model_dir, batches):
    """8 episodes in 4 GRPO groups, 4 of them of two segments (12 rows): each segment takes its
    episode's advantage, the group baseline counting episodes; the policy loss's gradients are
    -(1/N) sum over every sampled token of every segment of A_episode * grad log p (on-policy,
    token-mean). FSDP2 over 2 ranks gives the same gradients (`episodes_match_one_process`, on the
    fsdp2 layout's group)."""
    batch, counts, algo = episode_batch(batches)
    per_episode = torch.tensor([0.7071, -0.7071, -0.7071, 0.7071, 0.0, 0.0, -0.7071, 0.7071])  # (r - mean) / std
    expected = per_episode[EPISODE_OF].unsqueeze(1) * batch["loss_mask"]
    assert (batch["advantages"] - expected).abs().max() < 1e-4

    _, grads = reference_gradients(tiny_model_dir, batch, actor_loss(counts, algo))
    model = reference_model(tiny_model_dir)
    logprobs = logprobs_of_labels(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                                  batch["input_ids"])
    by_hand = -(batch["advantages"][:, 1:] * logprobs * batch["loss_mask"][:, 1:]).sum() / counts["tokens"]
    by_hand.backward()
    assert_gradients_match(grads, {name: p.grad for name, p in model.named_parameters()})
