"""The `rm` stage: Bradley-Terry on preference pairs gives one process's loss and gradients on 2
FSDP2 ranks and on tp=2; the stage trains, and its export is a sequence classifier that
transformers and vLLM score alike; a pipeline chains SFT -> RM -> RL."""

from __future__ import annotations

import json
import math
import os
import zlib

import pytest
import torch
import worker_probes as probes
from parity import assert_gradients_match, trained_gradients

from rlsys.algorithms.preference_loss import bradley_terry_loss
from rlsys.config.training import DataConfig
from rlsys.data.batching import collate
from rlsys.data.preferences import load_preference_pairs

# One xdist worker runs this module (scripts/test.sh): its ranks and runs of 10-20 s each start among the
# groups, not among the single tests that fill in at the end.
pytestmark = pytest.mark.xdist_group("reward_model")

PAIRS = 8
SCALE, SEED = 0.05, 3


def pair_batch(model_dir: str, files: dict[str, str]):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pairs, _ = load_preference_pairs(DataConfig(train_files=[files["preferences"]], max_seq_len=32), tokenizer)
    return collate([e for pair in pairs[:PAIRS] for e in pair], tokenizer.pad_token_id)


def reference(model_dir: str, batch) -> tuple[float, dict[str, torch.Tensor]]:
    """One process: transformers' model with a one-output head in place of the LM head, the same
    seeded noise on every weight as the ranks add (`perturb_parameters`), Bradley-Terry's loss."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.lm_head = torch.nn.Linear(model.config.hidden_size, 1, bias=False)
    torch.nn.init.zeros_(model.lm_head.weight)
    with torch.no_grad():
        for name, p in model.named_parameters():
            generator = torch.Generator().manual_seed(SEED * 1_000_003 + zlib.crc32(name.encode()))
            p.add_(torch.randn(p.shape, generator=generator) * SCALE)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    out = bradley_terry_loss(PAIRS)(logits, batch)
    out.loss.backward()
    return out.loss.item(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("layout", [["parallel.dp_shard=2"], ["parallel.dp_shard=1", "parallel.tp=2"]],
                         ids=["fsdp2", "tp2"])
def test_bradley_terry_loss_and_gradients_equal_one_process(layout, ray_cluster, sft_config, tiny_model_dir,
                                                            arith_files):
    from rlsys.actors.train_group import TrainGroup
    from rlsys.actors.train_worker import build_worker_spec

    batch = pair_batch(tiny_model_dir, arith_files)
    cfg = sft_config(*layout, "train.micro_batch_size=2")
    group = TrainGroup(build_worker_spec(cfg, 2 * cfg.train.micro_batch_size, 1, value_head=True), cfg.ray)
    try:
        group.on_each(probes.perturb_parameters, SCALE, SEED)
        [(metrics, grads)] = trained_gradients(group, (batch, bradley_terry_loss(PAIRS)))
    finally:
        group.shutdown()
    loss, expected = reference(tiny_model_dir, batch)
    assert metrics["loss"] == pytest.approx(loss, rel=1e-5)
    assert 0 <= metrics["rm/accuracy"] <= 1
    assert_gradients_match(grads, expected)


def test_rm_stage_trains_and_exports_a_sequence_classifier(ray_cluster, sft_config, tiny_model_dir, arith_files,
                                                           tmp_path):
    """The stage learns to rank 16 pairs (each problem's answer over a near miss; a random model
    cannot know the sums, so it learns these pairs; its zero head ranks none at first), and its
    export is a one-label `*ForSequenceClassification` directory whose score transformers and a
    vLLM reward-model engine compute alike (within 1e-4)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlsys.actors.served_models import ServedModelWorker
    from rlsys.config.rollout import ServingConfig
    from rlsys.rewards.model_terms import Exchange, reward_model_text
    from rlsys.stages.lm_trainer import run_lm_training

    lines = open(arith_files["preferences"]).readlines()
    pairs, scored = tmp_path / "pairs.jsonl", tmp_path / "scored.jsonl"
    pairs.write_text("".join(lines[:16]))
    scored.write_text("".join(lines[:15]))  # the first 14 are scored: 7 on each rank
    cfg = sft_config(f"data.train_files=[{pairs}]", f"data.val_files=[{scored}]", "train.steps=40",
                     "train.val_every=20", "train.global_batch_size=16", "train.micro_batch_size=4", "optim.lr=5e-3")
    summary = run_lm_training(cfg, "rm")
    rows = [json.loads(line) for line in open(os.path.join(cfg.output_dir, "metrics.jsonl"))]
    accuracy = [row["rm/accuracy"] for row in rows if "rm/accuracy" in row]
    assert accuracy[0] < 0.75 and min(accuracy[-3:]) >= 0.9, accuracy
    validated = {row["step"]: row for row in rows if "val/rm_accuracy" in row}
    assert sorted(validated) == [0, 20, 40]
    # the zero head scores every response 0: no pair ranked, Bradley-Terry's loss log 2
    assert validated[0]["val/rm_accuracy"] == 0 and validated[0]["val/loss"] == pytest.approx(math.log(2))
    assert validated[40]["val/rm_accuracy"] >= 0.9 and validated[40]["val/rm_margin"] > 0
    assert summary["val_rm_accuracy_after"] == validated[40]["val/rm_accuracy"]

    exported = summary["hf_model"]
    config = json.load(open(os.path.join(exported, "config.json")))
    assert config["architectures"] == ["Qwen2ForSequenceClassification"] and len(config["id2label"]) == 1
    tokenizer = AutoTokenizer.from_pretrained(exported)
    model = AutoModelForSequenceClassification.from_pretrained(exported, dtype=torch.float32).eval()
    exchanges = [Exchange(({"role": "user", "content": "12+30="},), "", answer) for answer in ("42", "43", "32")]
    with torch.no_grad():
        expected = [model(torch.tensor([tokenizer(reward_model_text(tokenizer, e), add_special_tokens=False)
                                        ["input_ids"]])).logits[0, 0].item() for e in exchanges]
    worker = ServedModelWorker(exported, ServingConfig(engine_memory_gib=0.1), seed=0, num_threads=2, pooling=True)
    try:
        served = worker.reward_scores(exchanges)
    finally:
        worker.shutdown()
    assert served == pytest.approx(expected, abs=1e-4)
