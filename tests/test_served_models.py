"""Frozen models in the loop: a reward model's score and a teacher's log-probs served by vLLM equal
transformers' forward; a judge's verdicts parse or count as failures; a teacher with another
tokenizer is refused; an RL run distils a teacher and scores with a reward model."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch

from rlsys.config.loader import ConfigError
from rlsys.config.rl import JudgeConfig, RewardTerm
from rlsys.config.rollout import ServingConfig
from rlsys.rewards.model_terms import Exchange, VerdictError, parse_verdict, reward_model_text, verdict_parser

# One xdist worker runs this module (scripts/test.sh): the reward model, built once.
pytestmark = pytest.mark.xdist_group("served_models")

SERVING = ServingConfig(engine_memory_gib=0.1)
EXCHANGES = [Exchange(({"role": "user", "content": "12+30="},), "", "42"),
             Exchange(({"role": "system", "content": "Add."}, {"role": "user", "content": "7+5="}), "", "13"),
             Exchange(None, "3+4=", "7")]


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory) -> str:
    from rlsys.models.tiny import TinyModelSpec, write_tiny_model

    return write_tiny_model(str(tmp_path_factory.mktemp("rm")), TinyModelSpec(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=105, reward_head=True, seed=3))


def test_reward_model_scores_equal_transformers_forward(reward_model_dir):
    """The engine's score is the model's one logit of the conversation in its chat template (or the
    policy's prompt text and the response): transformers' forward of the same tokens, within 1e-4."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlsys.actors.served_models import ServedModelWorker

    worker = ServedModelWorker(reward_model_dir, SERVING, seed=0, num_threads=2, pooling=True)
    try:
        served = worker.reward_scores(EXCHANGES)
    finally:
        worker.shutdown()
    tokenizer = AutoTokenizer.from_pretrained(reward_model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir, dtype=torch.float32).eval()
    texts = [reward_model_text(tokenizer, e) for e in EXCHANGES]
    assert texts[0].index("12+30=") < texts[0].index("42")  # the response as the assistant's turn
    assert texts[2] == "3+4=7"  # no messages: the policy's prompt text, then the response
    with torch.no_grad():
        expected = [model(torch.tensor([tokenizer(t, add_special_tokens=False)["input_ids"]])).logits[0, 0].item()
                    for t in texts]
    assert served == pytest.approx(expected, abs=1e-4)
    assert len(set(round(s, 4) for s in served)) == 3


SEQUENCES = [([5, 17, 23, 9, 40, 41], 3), ([8, 8, 30, 2, 61], 2)]
"""(token ids, start): a prompt and a response, the response's log-probs asked from `start`."""


def test_teacher_logprobs_equal_transformers_forward(tiny_model_dir):
    """vLLM's prompt log-probs of prompt + response, from the response's first token: the causal
    LM's log-softmax at each position, taken at the next token; with top-k, that position's k
    likeliest tokens in order and their log-probs."""
    from rlsys.actors.served_models import ServedModelWorker

    worker = ServedModelWorker(tiny_model_dir, SERVING, seed=0, num_threads=2, pooling=False)
    try:
        served, top = worker.token_logprobs(SEQUENCES), worker.token_logprobs(SEQUENCES, top_k=3)
    finally:
        worker.shutdown()
    for (ids, start), got, got_top, logprobs in zip(SEQUENCES, served, top, _causal_logprobs(tiny_model_dir)):
        expected = [logprobs[i - 1, ids[i]].item() for i in range(start, len(ids))]
        assert got.sampled == pytest.approx(expected, abs=1e-4) and not got.top_ids
        assert got_top.sampled == pytest.approx(expected, abs=1e-4)
        values, indices = logprobs[start - 1:len(ids) - 1].topk(3, dim=-1)
        assert got_top.top_ids == indices.tolist()
        assert torch.tensor(got_top.top_logprobs) == pytest.approx(values, abs=1e-4)


def test_a_released_engine_process_serves_the_next_model(reward_model_dir, tiny_model_dir):
    """What a kept served engine does between groups (`kept_actors`): a reward model's engine,
    released, is built again in its process as a teacher's, whose log-probs are the causal LM's."""
    from rlsys.actors.served_models import ServedModelWorker

    worker = ServedModelWorker(reward_model_dir, SERVING, seed=0, num_threads=2, pooling=True)
    try:
        assert len(worker.reward_scores(EXCHANGES)) == 3
        assert worker.release()
        worker.reuse(None, tiny_model_dir, SERVING, 0, 2, False)
        served = worker.token_logprobs(SEQUENCES)
    finally:
        worker.shutdown()
    for (ids, start), got, logprobs in zip(SEQUENCES, served, _causal_logprobs(tiny_model_dir)):
        assert got.sampled == pytest.approx([logprobs[i - 1, ids[i]].item() for i in range(start, len(ids))],
                                            abs=1e-4)


def _causal_logprobs(model_dir: str) -> list[torch.Tensor]:
    """transformers' log-softmax at every position of each of `SEQUENCES`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0].log_softmax(-1) for ids, _ in SEQUENCES]


@pytest.mark.quick
def test_a_verdict_parses_by_regex_or_by_function_and_fails_otherwise(tmp_path):
    regex = verdict_parser(JudgeConfig(template="t", parse=r"score:\s*(\d+)"), "reward.terms[0].judge")
    assert parse_verdict(regex, "Fine. score: 7 out of 10") == 7.0
    with pytest.raises(VerdictError, match="no match"):
        parse_verdict(regex, "I cannot say")
    user = tmp_path / "parse.py"
    user.write_text("def verdict(text):\n    return {'yes': 1.0, 'no': 0.0}[text.strip().lower()]\n")
    parser = verdict_parser(JudgeConfig(template="t", parse=f"{user}:verdict"), "reward.terms[0].judge")
    assert parse_verdict(parser, " Yes") == 1.0
    with pytest.raises(VerdictError, match="KeyError"):
        parse_verdict(parser, "maybe")
    with pytest.raises(ConfigError, match=r"reward.terms\[0\].judge.parse: not a regular expression"):
        verdict_parser(JudgeConfig(template="t", parse="(unclosed"), "reward.terms[0].judge")


@pytest.mark.quick
def test_bad_model_terms_and_teachers_are_refused_with_one_line(tiny_model_dir, reward_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from rlsys.rewards.model_terms import check_model_term
    from rlsys.rl.distillation import check_teacher

    with pytest.raises(ConfigError, match=r"reward.terms\[1\].model: a reward model has a one-logit"):
        check_model_term(RewardTerm(model=tiny_model_dir), "reward.terms[1]")
    with pytest.raises(ConfigError, match=r"reward.terms\[0\].model: a judge generates"):
        check_model_term(RewardTerm(model=reward_model_dir, judge=JudgeConfig(template="x")), "reward.terms[0]")
    template = tmp_path / "judge.txt"
    template.write_text("Rate {answer}")
    with pytest.raises(ConfigError, match=r"reward.terms\[0\].judge.template: .*judge.txt: fields are"):
        check_model_term(RewardTerm(model=tiny_model_dir, judge=JudgeConfig(template=str(template))),
                         "reward.terms[0]")
    with pytest.raises(ConfigError, match="algorithm.distill.teacher: the teacher must be a causal LM"):
        check_teacher(reward_model_dir, tiny_model_dir)

    other = tmp_path / "other_tokenizer"
    import shutil

    shutil.copytree(tiny_model_dir, other)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_tokens(["<extra>"])
    tokenizer.save_pretrained(other)
    with pytest.raises(ConfigError) as err:
        check_teacher(str(other), tiny_model_dir)
    assert str(err.value) == ("algorithm.distill.teacher: its tokenizer differs from model.path's (105 vs 104 "
                              "tokens, 1 mapped differently); distillation compares log-probs of the same token ids")
    check_teacher(tiny_model_dir, tiny_model_dir)


def test_distillation_with_a_reward_model_and_a_judge_in_the_loop(rl_config, tiny_model_dir, reward_model_dir,
                                                                  tmp_path, ray_cluster):
    """A teacher pulls the policy: the teacher is the policy with its LM head 8x sharper (the same
    tokenizer, a far more peaked distribution), and the exact KL(policy || teacher) of the first
    response token, over every token of the vocabulary, falls. Beside the verifier, a reward model
    and a judge score every response with weight 0 (logged, not trained on: GRPO would scale their
    random scores to the size of the teacher's signal). The random judge's verdicts rarely hold a
    digit: the others count in reward/errors and the run goes on. A teacher held by the training
    group instead of an engine gives step 1 the same log-probs."""
    from rlsys.stages.rl_setup import load_rl_data
    from rlsys.stages.rl_trainer import run_rlvr

    teacher = _sharper_teacher(tiny_model_dir, str(tmp_path / "teacher"))
    template = tmp_path / "judge.txt"
    template.write_text("Question: {prompt}\nAnswer: {response}\nTruth: {ground_truth}\nScore 0-9:")
    cfg = rl_config(
        "train.steps=10", "train.val_every=0", "train.save_every=0", "eval=null", "algorithm.kl_coef=0",
        "algorithm.ppo_epochs=1", "algorithm.ppo_mini_batch_size=0", "rollout.temperature=1.0",
        f"algorithm.distill.teacher={teacher}", "algorithm.distill.coef=1.0",
        "algorithm.distill.serving.engine_memory_gib=0.1", "optim.lr=1e-2", "optim.warmup_steps=0",
        f"reward.terms=[{{name: arith}}, {{name: rm, model: {reward_model_dir}, weight: 0.0, normalize: sigmoid, "
        f"serving: {{engine_memory_gib: 0.1}}}}, {{name: judge, model: {teacher}, weight: 0.0, "
        f"judge: {{template: {template}, parse: '(\\d)', max_new_tokens: 4}}, serving: {{engine_memory_gib: 0.1}}}}]")
    run_rlvr(cfg)
    rows = [json.loads(line) for line in open(os.path.join(cfg.output_dir, "metrics.jsonl"))]
    prompts = [p.text for p in load_rl_data(cfg).prompts[:16]]
    before, after = (_first_token_kl(policy, teacher, prompts)
                     for policy in (tiny_model_dir, os.path.join(cfg.output_dir, "hf_model")))
    assert after < 0.85 * before, (before, after)
    assert all(row["distill/reverse_kl"] > 0 and row["distill/teacher_logprob_mean"] < 0 for row in rows)
    assert sum(row["reward/errors"] for row in rows) > 0
    for row in rows:
        assert 0 < row["reward/rm"] < 1  # the reward model's sigmoid
        assert 0 <= row["reward/judge"] <= 9  # a digit, where a verdict holds one
        assert row["time/teacher_s"] > 0

    # the teacher held by the training group (its forward in the policy's layout: 2 FSDP2 ranks)
    # scores step 1's samples, the same as above, as its vLLM engine did
    in_trainer = replace(cfg, output_dir=str(tmp_path / "in_trainer"), train=replace(cfg.train, steps=1),
                         reward=replace(cfg.reward, terms=cfg.reward.terms[:1]),
                         algorithm=replace(cfg.algorithm, distill=replace(cfg.algorithm.distill, source="trainer")))
    run_rlvr(in_trainer)
    first = json.loads(open(os.path.join(in_trainer.output_dir, "metrics.jsonl")).readline())
    for name in ("distill/reverse_kl", "distill/teacher_logprob_mean", "distill/policy_logprob_mean"):
        assert first[name] == pytest.approx(rows[0][name], abs=1e-5), name


def test_top_k_distillation_pulls_the_policy_and_a_teacher_in_the_trainer_agrees(rl_config, tiny_model_dir,
                                                                                 tmp_path, ray_cluster):
    """Distillation alone (no reward term) with the teacher's top 8 tokens a position: the loss's
    KL over them falls and the policy's mass on them grows, and so does the exact KL(policy ||
    teacher) of the first response token over the whole vocabulary. The teacher held by the training
    group (2 FSDP2 ranks) gives step 1 the same top-k KL as its vLLM engine."""
    from rlsys.stages.rl_setup import load_rl_data
    from rlsys.stages.rl_trainer import run_rlvr

    teacher = _sharper_teacher(tiny_model_dir, str(tmp_path / "teacher"))
    cfg = rl_config(
        "train.steps=10", "train.val_every=0", "train.save_every=0", "eval=null", "algorithm.kl_coef=0",
        "algorithm.ppo_epochs=1", "algorithm.ppo_mini_batch_size=0", "rollout.temperature=1.0", "reward.terms=[]",
        f"algorithm.distill.teacher={teacher}", "algorithm.distill.top_k=8",
        "algorithm.distill.serving.engine_memory_gib=0.1", "optim.lr=1e-2", "optim.warmup_steps=0")
    run_rlvr(cfg)
    rows = [json.loads(line) for line in open(os.path.join(cfg.output_dir, "metrics.jsonl"))]
    kls, masses = ([row[f"distill/{name}"] for row in rows] for name in ("top_k_kl", "policy_top_k_mass"))
    assert kls[-1] < 0.85 * kls[0] and masses[-1] > 1.5 * masses[0], (kls, masses)  # its mass onto the teacher's
    assert all(0 < row["distill/teacher_top_k_mass"] <= 1 for row in rows)
    prompts = [p.text for p in load_rl_data(cfg).prompts[:16]]
    before, after = (_first_token_kl(policy, teacher, prompts)
                     for policy in (tiny_model_dir, os.path.join(cfg.output_dir, "hf_model")))
    assert after < 0.85 * before, (before, after)

    in_trainer = replace(cfg, output_dir=str(tmp_path / "in_trainer"), train=replace(cfg.train, steps=1),
                         algorithm=replace(cfg.algorithm, distill=replace(cfg.algorithm.distill, source="trainer")))
    run_rlvr(in_trainer)
    first = json.loads(open(os.path.join(in_trainer.output_dir, "metrics.jsonl")).readline())
    for name in ("distill/top_k_kl", "distill/teacher_top_k_mass", "distill/reverse_kl"):
        assert first[name] == pytest.approx(rows[0][name], abs=1e-5), name


def _sharper_teacher(policy: str, out: str) -> str:
    """A teacher with the policy's tokenizer and a far more peaked distribution: its LM head 8x."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(policy).save_pretrained(out)
    return out


def _first_token_kl(policy: str, teacher: str, prompts: list[str]) -> float:
    """Mean over the prompts of KL(policy || teacher) of the response's first token, exactly."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(policy)
    ids = [torch.tensor([tokenizer(p, add_special_tokens=False)["input_ids"]]) for p in prompts]

    def next_token_logprobs(path: str) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            return torch.stack([model(x).logits[0, -1].log_softmax(-1) for x in ids])

    p, t = next_token_logprobs(policy), next_token_logprobs(teacher)
    return (p.exp() * (p - t)).sum(-1).mean().item()
