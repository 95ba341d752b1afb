"""FSDP2 on 2 gloo ranks gives the single-process gradient of the same global batch."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlsys.actors.train_worker import build_worker_spec
from rlsys.actors.worker_group import TrainGroup
from rlsys.algorithms.lm_loss import masked_nll_sum, token_logprobs
from rlsys.config.schema import DataConfig
from rlsys.data.batching import collate, num_targets
from rlsys.data.examples import load_sft_examples


def reference_gradients(model_dir: str, batch) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    logprobs = token_logprobs(model, batch["input_ids"], batch["attention_mask"])
    (masked_nll_sum(logprobs, batch["loss_mask"]) / num_targets(batch)).backward()
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize(("dp_shard", "dp_replicate"), [(2, 1), (1, 2)])
def test_fsdp2_gradients_match_single_process(ray_cluster, sft_config, tiny_model_dir, arith_files,
                                              dp_shard, dp_replicate):
    cfg = sft_config(f"parallel.dp_shard={dp_shard}", f"parallel.dp_replicate={dp_replicate}",
                     "train.global_batch_size=12", "train.micro_batch_size=2")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    examples, _ = load_sft_examples(DataConfig(train_files=[arith_files["sft"]], max_seq_len=32), tokenizer)
    batch = collate(examples[:12], tokenizer.pad_token_id)  # 3 micro-batches of varying length per rank
    expected = reference_gradients(tiny_model_dir, batch)

    group = TrainGroup(build_worker_spec(cfg, cfg.train.micro_batch_size, cfg.train.steps), cfg.ray)
    try:
        group.run_data_parallel("forward_backward", batch, num_global_targets=num_targets(batch))
        got = group.run_all("full_gradients")
        local_shapes = group.run_all("local_shapes")
    finally:
        group.shutdown()

    assert got[0].keys() == expected.keys()
    for name, ref in expected.items():
        relative = (got[0][name] - ref).norm() / ref.norm()
        assert relative < 1e-5, f"{name}: relative gradient error {relative:.2e}"
        assert torch.equal(got[0][name], got[1][name])
    vocab_rows = expected["model.embed_tokens.weight"].shape[0]
    assert local_shapes[0]["model.embed_tokens.weight"][0] == vocab_rows // dp_shard
