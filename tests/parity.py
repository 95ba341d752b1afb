"""The single-process references the layout tests compare against, and the batches they use:
what a training group's loss, gradients and log-probs must equal in any layout."""

from __future__ import annotations

import pytest
import torch
import worker_probes as probes
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlsys.actors.train_worker import TrainWorker
from rlsys.algorithms.actor_loss import ActorInputs, actor_loss
from rlsys.algorithms.distill import TOP_IDS, TOP_LOGPROBS
from rlsys.algorithms.lm_loss import logprobs_of_labels, nll_loss
from rlsys.config.rl import AlgorithmConfig, DistillConfig
from rlsys.config.training import DataConfig
from rlsys.data.batching import collate, collate_rollouts, micro_batches, num_targets
from rlsys.data.examples import load_sft_examples
from rlsys.data.packing import pack_rows

MICRO_BATCH = 3
ALGO = AlgorithmConfig(kl_coef=0.1, clip_ratio_low=0.1, clip_ratio_high=0.1,
                       distill=DistillConfig(teacher="(its top-k tokens in the batch)", top_k=4, coef=0.5))
RL_INPUTS = ActorInputs(old_logprobs=True, ref_logprobs=True, teacher_top_k=True)
"""What `with_rl_fields` adds to an RL batch beside its advantages."""


def parity_batches(tiny_model_dir: str, arith_files: dict[str, str], max_seq_len: int = 32):
    """12 SFT rows, and an RL mini-batch of 4 GRPO groups: 3 responses (those of 3 SFT rows) to
    one prompt each, per-row advantages on the response tokens, old and reference log-probs
    nearby, a teacher's top-4 tokens a position. Of every 3 SFT rows (a micro-batch), two are cut
    to 5 tokens, every one a target (as in pretraining), so that packing lays them into one row;
    each RL micro-batch is one group, whose prompt packing lays out once. `max_seq_len` must hold a
    templated problem (a real model's template adds a system prompt)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    examples, _ = load_sft_examples(DataConfig(train_files=[arith_files["sft"]], max_seq_len=max_seq_len), tokenizer)
    sft = collate(examples[:12], tokenizer.pad_token_id)
    short = torch.arange(12) % 3 != 0
    sft["input_ids"][short, 5:] = tokenizer.pad_token_id
    sft["attention_mask"][short, 5:] = 0
    sft["loss_mask"][short] = sft["attention_mask"][short].float()
    assert all(len(pack_rows(micro).batch["input_ids"]) == 2 for micro in micro_batches(sft, MICRO_BATCH))

    prompt_of = lambda e: e.input_ids[:e.loss_mask.index(1)]  # noqa: E731
    rl = collate_rollouts([prompt_of(examples[i - i % MICRO_BATCH]) for i in range(12)],
                          [e.input_ids[len(prompt_of(e)):] for e in examples[:12]], tokenizer.pad_token_id)
    for micro in micro_batches(rl, MICRO_BATCH):
        assert pack_rows(micro).batch["attention_mask"].sum() < micro["attention_mask"].sum()
    return sft, rl, with_rl_fields(tiny_model_dir, rl, len(tokenizer))


def long_answer_batch(tiny_model_dir: str):
    """An RL mini-batch of 4 groups of 3 random 80-token answers, each group's contexts a tree: one
    row's a random 80-token prompt, the two others' that prompt and a 20-token history (as an
    episode's later segments), with the fields of `parity_batches`'s: each micro-batch (a group) lays
    out the prompt once, the history once past it, and attends span by span."""
    vocab = len(AutoTokenizer.from_pretrained(tiny_model_dir))
    generator = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(3, vocab, (n,), generator=generator).tolist()  # noqa: E731
    prompts = [ids(80) for _ in range(4)]
    histories = [ids(20) for _ in range(4)]
    contexts = [prompts[i // MICRO_BATCH] + (histories[i // MICRO_BATCH] if i % MICRO_BATCH else []) for i in range(12)]
    rl = collate_rollouts(contexts, [ids(80) for _ in range(12)], pad_id=0)
    return rl, with_rl_fields(tiny_model_dir, rl, vocab)


def with_rl_fields(model_dir: str, rl, vocab: int) -> dict[str, int]:
    """Per-row advantages on the response tokens, old and reference log-probs near the model's, a
    teacher's top-4 tokens a position, added to `rl`; the loss's counts."""
    generator = torch.Generator().manual_seed(0)
    logprobs = reference_logprobs(model_dir, rl)
    noise = lambda: 0.05 * torch.randn(logprobs.shape, generator=generator)  # noqa: E731
    rows = len(rl["input_ids"])
    rl.update(advantages=torch.randn(rows, 1, generator=generator) * rl["loss_mask"],
              old_logprobs=logprobs + noise(), ref_logprobs=logprobs + noise())
    teacher = torch.randn(*logprobs.shape, vocab, generator=generator).mul(3).log_softmax(-1)
    rl[TOP_LOGPROBS], rl[TOP_IDS] = teacher.topk(ALGO.distill.top_k, dim=-1)  # distillation's dense term
    return {"tokens": num_targets(rl), "sequences": rows}


def reference_model(model_dir: str):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def reference_logprobs(model_dir: str, batch) -> torch.Tensor:
    with torch.no_grad():
        logits = reference_model(model_dir)(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return torch.nn.functional.pad(logprobs_of_labels(logits, batch["input_ids"]), (1, 0))


def reference_gradients(model_dir: str, batch, loss_fn) -> tuple[float, dict[str, torch.Tensor]]:
    model = reference_model(model_dir)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    out = loss_fn(logits, batch)
    out.loss.backward()
    return out.loss.item(), {name: p.grad for name, p in model.named_parameters()}


def merge_stages(per_rank: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One full gradient per name: pipeline stages hold different names, and every rank
    holding a name (its data- and tensor-parallel peers) must agree exactly."""
    merged: dict[str, torch.Tensor] = {}
    for rank_grads in per_rank:
        for name, grad in rank_grads.items():
            assert name not in merged or torch.equal(merged[name], grad), name
            merged.setdefault(name, grad)
    return merged


def trained_gradients(group, *batches_and_losses) -> list[tuple[dict[str, float], dict[str, torch.Tensor]]]:
    """For each (batch, loss function): the group's metrics and full gradients of one forward and
    backward pass over the batch from zero gradients, with no optimizer step."""
    results = []
    for batch, loss_fn in batches_and_losses:
        group.on_each(probes.zero_grad)
        [metrics, *_] = probes.forward_backward(group, batch, loss_fn)
        results.append((metrics, merge_stages(group.on_each(probes.full_gradients))))
    return results


def layout_run(cfg, sft, rl, counts, then=None, inputs: ActorInputs = RL_INPUTS
               ) -> tuple[list[tuple[dict[str, float], dict[str, torch.Tensor]]], torch.Tensor,
                          list[dict[str, tuple[int, ...]]]]:
    """A training group in `cfg`'s layout on the parity batches: the metrics and full gradients of
    the SFT loss and of the RL policy loss (`trained_gradients`; `inputs`: what the RL batch holds), the
    SFT batch's log-probs, and each rank's local parameter shapes; `then(group)` runs last, before the
    group shuts down."""
    from rlsys.actors.train_group import TrainGroup
    from rlsys.actors.train_worker import build_worker_spec
    from rlsys.algorithms.lm_loss import nll_loss, token_logprobs

    group = TrainGroup(build_worker_spec(cfg, cfg.train.micro_batch_size, cfg.train.steps), cfg.ray)
    try:
        results = trained_gradients(group, (sft, nll_loss(num_targets(sft))), (rl, actor_loss(counts, ALGO, inputs)))
        logprobs = torch.cat([out["logprobs"] for out, _ in group.run_data_parallel(TrainWorker.forward, sft,
                                                                                    loss_fn=token_logprobs())])
        shapes = group.on_each(probes.local_shapes)
        assert all(group.on_each(probes.attends_spans_where_it_can))
        if then is not None:
            then(group)
        return results, logprobs, shapes
    finally:
        group.shutdown()


def assert_gradients_match(got: dict, expected: dict, tolerance: float = 1e-5) -> None:
    assert got.keys() == expected.keys()
    for name, ref in expected.items():
        relative = (got[name] - ref).norm() / ref.norm()
        assert relative < tolerance, f"{name}: relative gradient error {relative:.2e}"


def assert_layout_matches_single_process(cfg, model_dir: str, sft, rl, counts, logprob_tolerance: float = 1e-5,
                                         grad_tolerance: float = 1e-5, then=None
                                         ) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """The layout of `cfg` gives one process's SFT loss and gradients, RL-loss gradients and
    log-probs on the same batches (`then(group)` runs last, as in `layout_run`). Returns the
    reference SFT gradients and each rank's local parameter shapes, for a test's checks of how
    the layout holds them."""
    sft_loss, sft_grads = reference_gradients(model_dir, sft, nll_loss(num_targets(sft)))
    _, rl_grads = reference_gradients(model_dir, rl, actor_loss(counts, ALGO, RL_INPUTS))
    [(metrics, got_sft), (_, got_rl)], logprobs, local_shapes = layout_run(cfg, sft, rl, counts, then)
    assert metrics["loss"] == pytest.approx(sft_loss, rel=1e-5)
    assert_gradients_match(got_sft, sft_grads, grad_tolerance)
    assert_gradients_match(got_rl, rl_grads, grad_tolerance)
    expected = reference_logprobs(model_dir, sft) * sft["attention_mask"]
    assert (logprobs * sft["attention_mask"] - expected).abs().max() < logprob_tolerance
    return sft_grads, local_shapes
