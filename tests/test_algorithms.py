"""Advantage estimators, policy losses, KL estimators and aggregations against hand-computed
values (VeRL's semantics): groups of one, all-equal groups, padding holding NaN, log-ratios
of +-30; and estimators and losses registered from a user's file."""

from __future__ import annotations

import math

import pytest
import torch

from rlsys.algorithms.advantages import AdvantageInputs, compute_advantages
from rlsys.algorithms.aggregation import aggregate
from rlsys.algorithms.kl import kl_penalty
from rlsys.algorithms.policy_loss import (
    cispo_loss,
    clip_cov_loss,
    geo_mean_loss,
    gspo_loss,
    kl_cov_loss,
    ppo_clip_loss,
    reinforce_loss,
    sapo_loss,
)
from rlsys.config.rl import AlgorithmConfig, RolloutCorrectionConfig

pytestmark = pytest.mark.quick  # the quick tier (scripts/test.sh --quick)

SCORES = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.7]
GROUPS = [0, 0, 0, 0, 1, 1, 2]  # group 2 is a group of one, group 1 has equal rewards
LENGTHS = [3, 1, 2, 3, 2, 1, 2]


def rollouts() -> AdvantageInputs:
    """Responses of LENGTHS tokens after a 1-token prompt, scores on their last tokens."""
    mask = torch.zeros(len(SCORES), 5)
    rewards = torch.zeros(len(SCORES), 5)
    for row, (length, score) in enumerate(zip(LENGTHS, SCORES)):
        mask[row, 1:1 + length] = 1
        rewards[row, length] = score
    return AdvantageInputs(rewards, mask, torch.tensor(GROUPS))


def advantages(estimator: str, **options) -> torch.Tensor:
    inputs = rollouts()
    result = compute_advantages(inputs, AlgorithmConfig(adv_estimator=estimator, **options))
    assert (result[inputs.response_mask == 0] == 0).all()
    return result


def per_response(result: torch.Tensor) -> list[float]:
    """The advantage of each response, checking it is the same on every one of its tokens."""
    values = []
    for row, length in enumerate(LENGTHS):
        tokens = result[row, 1:1 + length]
        assert torch.allclose(tokens, tokens[0].expand_as(tokens))
        values.append(tokens[0].item())
    return values


def whiten(values: list[float], lengths: list[int]) -> list[float]:
    """VeRL's masked whitening over every response token (unbiased variance), by hand."""
    tokens = [v for v, n in zip(values, lengths) for _ in range(n)]
    mean = sum(tokens) / len(tokens)
    var = sum((t - mean) ** 2 for t in tokens) / (len(tokens) - 1)
    return [(v - mean) / math.sqrt(var + 1e-8) for v in values]


def test_grpo_and_dr_grpo_by_hand():
    std = math.sqrt(4 * 0.25 / 3)  # group 0: mean 0.5, unbiased std
    expected = [0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std, 0.0, 0.0, 0.7]  # a group of one: its raw score
    assert per_response(advantages("grpo")) == pytest.approx(expected, abs=1e-5)
    assert per_response(advantages("grpo", norm_adv_by_std=False)) == pytest.approx(
        [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.7], abs=1e-6)


def test_rloo_subtracts_the_mean_of_the_other_responses():
    assert per_response(advantages("rloo")) == pytest.approx(
        [1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3, 0.0, 0.0, 0.7], abs=1e-6)


def test_reinforce_plus_plus_baseline_whitens_group_centred_scores_over_tokens():
    centred = [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.7]
    assert per_response(advantages("reinforce_plus_plus_baseline")) == pytest.approx(
        whiten(centred, LENGTHS), abs=1e-5)


def test_reinforce_plus_plus_whitens_discounted_returns():
    assert per_response(advantages("reinforce_plus_plus")) == pytest.approx(whiten(SCORES, LENGTHS), abs=1e-5)
    # gamma 0.5: a response's token t carries its score x 0.5^(tokens after t)
    result = advantages("reinforce_plus_plus", gamma=0.5)
    returns = [score * 0.5 ** (length - 1 - t) for score, length in zip(SCORES, LENGTHS) for t in range(length)]
    mean = sum(returns) / len(returns)
    std = math.sqrt(sum((r - mean) ** 2 for r in returns) / (len(returns) - 1) + 1e-8)
    mask = rollouts().response_mask.bool()
    assert result[mask].tolist() == pytest.approx([(r - mean) / std for r in returns], abs=1e-5)


ALGO = AlgorithmConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)


def test_pass_at_k_grpo_opo_and_gpg_by_hand():
    # pass@k: only a group's best response gets (best - second best) / (std + 1e-6): 0 where the
    # best two tie (every group here), and for a group of one
    assert per_response(advantages("grpo_passk")) == pytest.approx([0.0] * 7)
    scores = [0.3, 1.0, 0.0, 0.6]
    inputs = AdvantageInputs(*_rows(scores, [3, 1, 2, 3]), torch.tensor([0, 0, 0, 0]))
    result = compute_advantages(inputs, AlgorithmConfig(adv_estimator="grpo_passk"))
    assert result[1, 1].item() == pytest.approx((1.0 - 0.6) / (torch.tensor(scores).std().item() + 1e-6), abs=1e-5)
    assert result.count_nonzero() == 1
    result = compute_advantages(inputs, AlgorithmConfig(adv_estimator="grpo_passk", norm_adv_by_std=False))
    assert result[1, 1].item() == pytest.approx(0.4, abs=1e-6) and result.count_nonzero() == 1
    # OPO: the baseline is the group's length-weighted mean score
    baseline = (3 * 1.0 + 1 * 0.0 + 2 * 0.0 + 3 * 1.0) / 9
    assert per_response(advantages("opo")) == pytest.approx(
        [1 - baseline, -baseline, -baseline, 1 - baseline, 0.0, 0.0, 0.7], abs=1e-6)
    # GPG: alpha (7 responses / 5 with a non-zero score) x (score - group mean)
    alpha = 7 / 5
    assert per_response(advantages("gpg")) == pytest.approx(
        [alpha * 0.5, -alpha * 0.5, -alpha * 0.5, alpha * 0.5, 0.0, 0.0, alpha * 0.7], abs=1e-6)


def _rows(scores: list[float], lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    mask, rewards = torch.zeros(len(scores), 5), torch.zeros(len(scores), 5)
    for row, (length, score) in enumerate(zip(lengths, scores)):
        mask[row, 1:1 + length] = 1
        rewards[row, length] = score
    return rewards, mask


def test_ppo_clip_with_dual_clip_by_hand():
    old = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5, 0.2]))
    new = torch.log(torch.tensor([0.75, 0.25, 0.75, 0.55, 0.8]))  # ratios 1.5, 0.5, 1.5, 1.1, 4
    adv = torch.tensor([1.0, -1.0, -1.0, 2.0, -1.0])
    terms = ppo_clip_loss(new, old, adv, torch.ones(5), ALGO)
    # A>0, r=1.5: clipped at 1.28. A<0, r=0.5: max(0.5, 0.8) = 0.8 (clipped). A<0, r=1.5: 1.5 (unclipped,
    # under the dual clip's 3). A>0, r=1.1: inside, -2.2. A<0, r=4: max(4, 1.28) = 4, dual clip -> 3.
    assert terms.per_token.tolist() == pytest.approx([-1.28, 0.8, 1.5, -2.2, 3.0], abs=1e-5)
    assert terms.clipped.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert terms.clipped_lower.tolist() == [0.0, 0.0, 0.0, 0.0, 1.0]


def test_log_ratios_of_30_stay_finite():
    old = torch.zeros(4)
    new = torch.tensor([30.0, 30.0, -30.0, -30.0], requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    terms = ppo_clip_loss(new, old, adv, torch.ones(4), ALGO)
    # log-ratio clamped to +-20: A>0 clipped at 1.28; A<0 bounded by the dual clip at 3;
    # r = e^-20: A>0 unclipped (-e^-20), A<0 clipped at 0.8
    assert terms.per_token.tolist() == pytest.approx([-1.28, 3.0, -math.exp(-20), 0.8], abs=1e-6)
    terms.per_token.sum().backward()
    assert torch.isfinite(new.grad).all()
    assert kl_penalty(torch.tensor([30.0]), torch.tensor([0.0]), "low_var_kl").item() == 10.0  # VeRL's clamp


def test_gspo_uses_one_clipped_ratio_per_sequence():
    old = torch.zeros(2, 3)
    new = torch.tensor([[0.1, 0.3, float("nan")], [-0.2, float("nan"), float("nan")]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0, 0.0], [-1.0, 0.0, 0.0]])
    terms = gspo_loss(new, old, adv, mask, ALGO)
    # sequence log-ratios: mean(0.1, 0.3) = 0.2 and -0.2, both inside the clip range
    ratio_up, ratio_down = math.exp(0.2), math.exp(-0.2)
    assert terms.per_token[0, :2].tolist() == pytest.approx([-ratio_up] * 2, abs=1e-6)
    assert terms.per_token[1, 0].item() == pytest.approx(ratio_down, abs=1e-6)
    loss = aggregate(terms.per_token, mask, "seq-mean-token-mean", {"tokens": 3, "sequences": 2})
    assert loss.item() == pytest.approx((-ratio_up + ratio_down) / 2, abs=1e-6)
    loss.backward()
    # d loss / d log p_t = -A x ratio / (tokens in the sequence) / sequences
    assert new.grad[0, :2].tolist() == pytest.approx([-ratio_up / 4] * 2, abs=1e-6)
    assert new.grad[1, 0].item() == pytest.approx(ratio_down / 2, abs=1e-6)


def test_cispo_sapo_and_reinforce_by_hand():
    old = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5]))
    probs = torch.tensor([0.75, 0.25, 0.55, 0.8])  # ratios 1.5, 0.5, 1.1, 1.6
    new = torch.log(probs).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 2.0, -1.0])
    # CISPO: -sg(clip(r, 0.8, 1.28)) A log p; the gradient through log p even where clipped
    terms = cispo_loss(new, old, adv, torch.ones(4), ALGO)
    weights = torch.tensor([1.28, 0.8, 1.1, 1.28])
    assert terms.per_token.tolist() == pytest.approx((-weights * adv * torch.log(probs)).tolist(), abs=1e-6)
    assert terms.clipped.tolist() == [1.0, 1.0, 0.0, 1.0]
    (grad,) = torch.autograd.grad(terms.per_token.sum(), new)
    assert grad.tolist() == pytest.approx((-weights * adv).tolist(), abs=1e-6)
    # SAPO: -A sigmoid(tau (r - 1)) 4 / tau, tau 1 where A > 0 and 1.05 elsewhere
    ratios, taus = [1.5, 0.5, 1.1, 1.6], [1.0, 1.05, 1.0, 1.05]
    gates = [4 / tau / (1 + math.exp(-tau * (r - 1))) for r, tau in zip(ratios, taus)]
    assert sapo_loss(new, old, adv, torch.ones(4), ALGO).per_token.tolist() == pytest.approx(
        [-g * a for g, a in zip(gates, adv.tolist())], abs=1e-6)
    # at r = 1 the gate's slope is 1, PPO's: d/d log p = -A
    at_one = old.clone().requires_grad_()
    (grad,) = torch.autograd.grad(sapo_loss(at_one, old, adv, torch.ones(4), ALGO).per_token.sum(), at_one)
    assert grad.tolist() == pytest.approx((-adv).tolist(), abs=1e-6)
    assert reinforce_loss(new, old, adv, torch.ones(4), ALGO).per_token.tolist() == pytest.approx(
        (-adv * torch.log(probs)).tolist(), abs=1e-6)


def test_geo_mean_clips_each_log_ratio_on_its_pessimistic_side():
    old = torch.zeros(2, 3)
    new = torch.tensor([[0.5, -0.1, 9.0], [0.5, -0.5, 9.0]])  # the last column is padding
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0, 0.0], [-2.0, -2.0, 0.0]])
    terms = geo_mean_loss(new, old, adv, mask, ALGO)
    # A > 0: each log-ratio at most 0.28 -> mean(0.28, -0.1); A < 0: at least -0.2 -> mean(0.5, -0.2)
    assert terms.per_token[0, :2].tolist() == pytest.approx([-math.exp(0.09)] * 2, abs=1e-6)
    assert terms.per_token[1, :2].tolist() == pytest.approx([2 * math.exp(0.15)] * 2, abs=1e-6)
    assert terms.clipped.tolist() == [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]  # padding: A = 0
    assert terms.clipped_lower.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]


def test_clip_cov_and_kl_cov_act_on_the_tokens_of_largest_covariance():
    # advantages and log-probs rising together along the row: the last tokens covary most
    logprobs = torch.tensor([[-3.0, -2.0, -1.0, -0.5]])
    adv = torch.tensor([[-1.0, -0.5, 0.5, 3.0]])
    mask = torch.ones(1, 4)
    covariance = (adv - adv.mean()) * (logprobs - logprobs.mean())  # 2.25, 0.5, 0.125, 3.28
    assert covariance[0].argmax().item() == 3
    # KL-Cov, 25% of 4 tokens: the last one gets ppo_kl_coef x |log r| on top of -A r
    old = logprobs - 0.1
    algo = AlgorithmConfig(kl_cov_ratio=0.25, ppo_kl_coef=0.5)
    terms = kl_cov_loss(logprobs, old, adv, mask, algo)
    plain = (-adv * math.exp(0.1))[0].tolist()
    assert terms.per_token[0].tolist() == pytest.approx(plain[:3] + [plain[3] + 0.5 * 0.1], abs=1e-6)
    assert terms.clipped.tolist() == [[0.0, 0.0, 0.0, 1.0]]
    # Clip-Cov: of the tokens with covariance in (1, 5) and not clipped by PPO (the first and the
    # last), 25% of 4 = 1 is cut out of the gradient, drawn at random
    algo = AlgorithmConfig(clip_cov_ratio=0.25, clip_cov_lb=1.0, clip_cov_ub=5.0)
    cut = {clip_cov_loss(logprobs, old, adv, mask, algo).clipped[0].nonzero().item() for _ in range(40)}
    assert cut == {0, 3}
    terms = clip_cov_loss(logprobs, old, adv, mask, algo)
    kept = terms.clipped[0] == 0
    assert terms.per_token[0, kept].tolist() == pytest.approx(torch.tensor(plain)[kept].tolist(), abs=1e-6)
    assert (terms.per_token[0, ~kept] == 0).all()


def test_kl_estimators_under_both_names():
    p = torch.tensor([0.3, 0.6, 0.9])
    q = torch.tensor([0.5, 0.6, 0.2])
    logp, logq = p.log(), q.log()
    for names, expected in ((("k1", "kl"), (p / q).log()), (("k2", "mse"), 0.5 * (p / q).log() ** 2),
                            (("k3", "low_var_kl"), q / p - 1 - (q / p).log()), (("abs",), (p / q).log().abs())):
        for name in names:
            assert torch.allclose(kl_penalty(logp, logq, name), expected), name
    assert kl_penalty(logp, logq, "k3")[1] == 0 and (kl_penalty(logp, logq, "k3") >= 0).all()


def test_k3_is_an_unbiased_kl_estimate():
    torch.manual_seed(0)
    p = torch.tensor([0.7, 0.2, 0.1])
    q = torch.tensor([0.4, 0.4, 0.2])
    samples = torch.multinomial(p, 200_000, replacement=True)
    true_kl = (p * (p / q).log()).sum()
    for estimator in ("k1", "k3"):
        estimate = kl_penalty(p.log()[samples], q.log()[samples], estimator).mean()
        assert estimate == pytest.approx(true_kl.item(), rel=0.02)


def test_aggregations_by_hand():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), float("inf")]])  # padding: NaN, inf
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    counts = {"tokens": 4, "sequences": 2, "horizon": 5}
    assert aggregate(per_token, mask, "token-mean", counts).item() == pytest.approx(10 / 4)
    assert aggregate(per_token, mask, "seq-mean-token-mean", counts).item() == pytest.approx((2 + 4) / 2)
    assert aggregate(per_token, mask, "seq-mean-token-sum", counts).item() == pytest.approx((6 + 4) / 2)
    assert aggregate(per_token, mask, "seq-mean-token-sum-norm", counts).item() == pytest.approx(10 / (2 * 5))
    # split into two micro-batches, the shares add up to the whole
    halves = [aggregate(per_token[i:i + 1], mask[i:i + 1], "seq-mean-token-mean", counts) for i in (0, 1)]
    assert sum(halves).item() == pytest.approx(3.0)


def rl_batch():
    from rlsys.data.batching import collate_rollouts

    batch = collate_rollouts([[1, 2], [3, 4, 5]], [[6, 7, 8], [9]], pad_id=0)
    batch["advantages"] = torch.tensor([[1.0], [-2.0]]) * batch["loss_mask"]  # on the response tokens
    return batch


@pytest.mark.parametrize("loss", ["vanilla", "gspo", "cispo", "sapo", "geo_mean", "clip_cov", "kl_cov", "gpg"])
def test_nan_in_padding_never_reaches_the_loss(loss):
    from rlsys.algorithms.actor_loss import ActorInputs, actor_loss

    torch.manual_seed(0)
    batch = rl_batch()
    logits = torch.randn(2, batch["input_ids"].shape[1], 16, requires_grad=True)
    old = torch.randn(batch["input_ids"].shape) * 0.1
    algo = AlgorithmConfig(policy_loss=loss, kl_coef=0.1)
    loss_fn = actor_loss({"tokens": 4, "sequences": 2}, algo, ActorInputs(old_logprobs=True, ref_logprobs=True))
    clean = {**batch, "old_logprobs": old * batch["loss_mask"], "ref_logprobs": old * batch["loss_mask"]}
    padding = batch["loss_mask"] == 0
    dirty = {name: value.masked_fill(padding, float("nan")) if name in ("advantages", "old_logprobs", "ref_logprobs")
             else value for name, value in clean.items()}
    (grad_clean,) = torch.autograd.grad(loss_fn(logits, clean).loss, logits)
    out = loss_fn(logits, dirty)
    (grad_dirty,) = torch.autograd.grad(out.loss, logits)
    assert torch.isfinite(out.loss) and torch.equal(grad_clean, grad_dirty)
    assert all(torch.isfinite(value) for value in out.metrics.values())


def test_on_policy_loss_equals_the_loss_with_recomputed_old_logprobs():
    """With no old_logprobs the policy loss takes the current ones, detached: the loss,
    gradient and log-prob rows equal those of a separate pass's old log-probs."""
    from rlsys.algorithms.actor_loss import ActorInputs, actor_loss
    from rlsys.algorithms.lm_loss import logprobs_of_labels
    from rlsys.data.batching import on_last_response_token, on_response_tokens

    torch.manual_seed(0)
    batch = rl_batch()
    logits = torch.randn(2, batch["input_ids"].shape[1], 16, requires_grad=True)
    algo, counts = AlgorithmConfig(clip_ratio_low=0.2, clip_ratio_high=0.28), {"tokens": 4, "sequences": 2}

    on_policy = actor_loss(counts, algo)(logits, batch)
    (grad_on_policy,) = torch.autograd.grad(on_policy.loss, logits)
    old = torch.nn.functional.pad(logprobs_of_labels(logits, batch["input_ids"]).detach(), (1, 0))
    recomputed = actor_loss(counts, algo, ActorInputs(old_logprobs=True))(logits, {**batch, "old_logprobs": old})
    (grad_recomputed,) = torch.autograd.grad(recomputed.loss, logits)

    assert on_policy.loss.item() == pytest.approx(recomputed.loss.item())
    assert grad_on_policy.abs().sum() > 0 and torch.allclose(grad_on_policy, grad_recomputed)
    assert torch.equal(on_policy.rows["logprobs"], old)
    # the engine's per-token values land on the response tokens, in row order
    placed = on_response_tokens(torch.tensor([0.1, 0.2, 0.3, 0.4]), batch)
    assert torch.allclose(placed * batch["loss_mask"], placed)
    assert torch.allclose(placed[0, 2:5], torch.tensor([0.1, 0.2, 0.3])) and placed[1, 3].item() == pytest.approx(0.4)
    # an outcome reward sits on each response's last token
    rewards = on_last_response_token(torch.tensor([1.0, 0.5]), batch)
    assert rewards[0, 4].item() == 1.0 and rewards[1, 3].item() == 0.5 and rewards.sum().item() == 1.5


def test_estimators_and_losses_registered_from_a_file(tmp_path):
    from rlsys.algorithms.actor_loss import actor_loss
    from rlsys.config.layout import ParallelConfig
    from rlsys.config.loader import ConfigError
    from rlsys.rl.algorithm_checks import check_algorithm

    extension = tmp_path / "my_algos.py"
    extension.write_text(
        "from rlsys.algorithms.advantages import register_advantage\n"
        "from rlsys.algorithms.policy_loss import PolicyLossTerms, register_policy_loss\n\n"
        "@register_advantage('sign')\n"
        "def sign(inputs, algo):\n"
        "    return inputs.token_rewards.sum(-1, keepdim=True).sign() * inputs.response_mask\n\n"
        "@register_policy_loss('my_reinforce')\n"
        "def my_reinforce(logprobs, old_logprobs, advantages, mask, algo):\n"
        "    return PolicyLossTerms(-advantages * logprobs, logprobs.new_zeros(logprobs.shape))\n")
    algo = AlgorithmConfig(adv_estimator="sign", policy_loss="my_reinforce", extensions=[str(extension)])
    check_algorithm(algo, ParallelConfig())
    result = compute_advantages(AdvantageInputs(torch.tensor([[0.0, -2.0], [0.0, 3.0]]), torch.tensor([[0.0, 1.0]] * 2),
                                                 torch.tensor([0, 0])), algo)
    assert result.tolist() == [[0.0, -1.0], [0.0, 1.0]]
    logits = torch.zeros(1, 3, 4, requires_grad=True)
    batch = {"input_ids": torch.tensor([[1, 2, 3]]), "loss_mask": torch.tensor([[0, 1, 1]]),
             "advantages": torch.tensor([[0.0, 1.0, 1.0]])}
    assert actor_loss({"tokens": 2, "sequences": 1}, algo)(logits, batch).loss.item() == pytest.approx(math.log(4))
    with pytest.raises(ConfigError, match="algorithm.adv_estimator: unknown advantage estimator 'nope'"):
        check_algorithm(AlgorithmConfig(adv_estimator="nope"), ParallelConfig())
    with pytest.raises(ConfigError, match="algorithm.extensions.0.: file not found"):
        check_algorithm(AlgorithmConfig(extensions=[str(tmp_path / "missing.py")]), ParallelConfig())
    for loss in ("gspo", "sapo", "geo_mean", "clip_cov", "kl_cov"):
        with pytest.raises(ConfigError, match=f"algorithm.policy_loss: {loss} reads whole sequences"):
            check_algorithm(AlgorithmConfig(policy_loss=loss), ParallelConfig(cp=2))
    check_algorithm(AlgorithmConfig(policy_loss="cispo"), ParallelConfig(cp=2))
    with pytest.raises(ConfigError, match="algorithm.loss_agg: seq-mean-token-mean averages each sequence's tokens"):
        check_algorithm(AlgorithmConfig(loss_agg="seq-mean-token-mean"), ParallelConfig(cp=2))
    with pytest.raises(ValueError, match="rollout_correction: with old_logprobs: rollout"):  # the section's own
        AlgorithmConfig(rollout_correction=RolloutCorrectionConfig(rollout_is="token"), old_logprobs="rollout")
    for per_sequence in ({"rollout_is": "sequence"}, {"rollout_rs": "geometric"},
                         {"rollout_token_veto_threshold": 0.1}):
        with pytest.raises(ConfigError, match="algorithm.rollout_correction: a sequence-level weight"):
            check_algorithm(AlgorithmConfig(rollout_correction=RolloutCorrectionConfig(**per_sequence)),
                            ParallelConfig(cp=2))


def correction(old_probs, rollout_probs, mask, **cfg):
    """correction_factors on probabilities written out by hand (one row, NaN where the engine
    left padding)."""
    from rlsys.algorithms.rollout_correction import correction_factors

    old = torch.tensor([[math.log(p) for p in old_probs]])
    rollout = torch.tensor([[math.log(p) if p == p else p for p in rollout_probs]])
    return correction_factors(old, rollout, torch.tensor([mask], dtype=torch.float), RolloutCorrectionConfig(**cfg))


# ratios pi_old / pi_rollout of the three response tokens: 3, 0.5, 1; the fourth is padding
RATIOS_3_HALF_1 = dict(old_probs=[0.6, 0.1, 0.5, 1.0], rollout_probs=[0.2, 0.2, 0.5, float("nan")],
                       mask=[1, 1, 1, 0])


def test_truncated_importance_weights_by_token_and_by_sequence():
    factors, metrics = correction(**RATIOS_3_HALF_1, rollout_is="token", rollout_is_threshold=2.0)
    assert torch.allclose(factors, torch.tensor([[2.0, 0.5, 1.0, 1.0]]))
    assert metrics["rollout_corr/truncated_frac"].tolist() == [[1.0, 0.0, 0.0, 0.0]]
    factors, metrics = correction(**RATIOS_3_HALF_1, rollout_is="sequence", rollout_is_threshold=2.0)
    assert torch.allclose(factors, torch.full((1, 4), 1.5))  # 3 x 0.5 x 1
    assert metrics["rollout_corr/truncated_frac"].sum() == 0
    factors, _ = correction([0.9, 0.9, 0.9, 1.0], [1e-13, 1e-13, 1e-13, 1.0], [1, 1, 1, 0],
                            rollout_is="sequence", rollout_is_threshold=2.0)  # a product of e^90: no overflow
    assert torch.allclose(factors, torch.full((1, 4), 2.0))


def test_batch_normalised_importance_weights_average_one():
    from rlsys.algorithms.rollout_correction import correction_factors, is_weight_mean
    from rlsys.config.schema import RLJobConfig
    from rlsys.rl.passes import old_logprobs_source

    # token weights 2, 0.5, 1 (truncated at 2): mean 7/6 over the response tokens, padding aside
    old = torch.tensor([[math.log(p) for p in [0.6, 0.1, 0.5, 1.0]]])
    rollout = torch.tensor([[math.log(p) for p in [0.2, 0.2, 0.5, 0.3]]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    token = RolloutCorrectionConfig(rollout_is="token", rollout_is_batch_normalize=True)
    assert is_weight_mean(old, rollout, mask, token) == pytest.approx(7 / 6)
    factors, _ = correction_factors(old, rollout, mask, token, weight_mean=7 / 6)
    assert factors[0, :3].tolist() == pytest.approx([2 * 6 / 7, 0.5 * 6 / 7, 6 / 7])
    assert masked_mean_of(factors, mask) == pytest.approx(1.0)
    # sequence: one weight a response (1.5 and 2 truncated from 4), an empty response left out
    old2 = torch.cat([old, torch.tensor([[math.log(0.8), 0.0, 0.0, 0.0]]), torch.zeros(1, 4)])
    rollout2 = torch.cat([rollout, torch.tensor([[math.log(0.2), 0.0, 0.0, 0.0]]), torch.zeros(1, 4)])
    mask2 = torch.cat([mask, torch.tensor([[1.0, 0.0, 0.0, 0.0]]), torch.zeros(1, 4)])
    sequence = RolloutCorrectionConfig(rollout_is="sequence", rollout_is_batch_normalize=True)
    assert is_weight_mean(old2, rollout2, mask2, sequence) == pytest.approx((1.5 + 2.0) / 2)
    # the driver needs the old log-probs before the update: a trainer pass even when on-policy
    cfg = RLJobConfig(model={"path": "m"}, data={"train_files": ["x"]}, reward={"terms": [{"name": "arith"}]},
                      algorithm={"rollout_correction": {"rollout_is": "token"}})
    assert old_logprobs_source(cfg) == "current"
    cfg.algorithm.rollout_correction.rollout_is_batch_normalize = True
    assert old_logprobs_source(cfg) == "trainer"


def masked_mean_of(values: torch.Tensor, mask: torch.Tensor) -> float:
    return ((values * mask).sum() / mask.sum()).item()


def test_rejection_by_token_sequence_and_geometric_mean():
    # token, [0.5, 2]: the ratio of 3 is dropped, 0.5 and 1 kept (IcePop's two-sided mask)
    factors, metrics = correction(**RATIOS_3_HALF_1, rollout_rs="token", rollout_rs_threshold=2.0)
    assert factors.tolist() == [[0.0, 1.0, 1.0, 1.0]]
    assert metrics["rollout_corr/rejected_frac"].tolist() == [[1.0, 0.0, 0.0, 0.0]]
    # a lower bound of 0.6 drops the 0.5 as well
    factors, _ = correction(**RATIOS_3_HALF_1, rollout_rs="token", rollout_rs_threshold=2.0,
                            rollout_rs_threshold_lower=0.6)
    assert factors.tolist() == [[0.0, 0.0, 1.0, 1.0]]
    # sequence: the product 1.5 lies within [0.5, 2]; within [1/1.4, 1.4] it does not
    assert correction(**RATIOS_3_HALF_1, rollout_rs="sequence", rollout_rs_threshold=2.0)[0].tolist() == [[1.0] * 4]
    assert correction(**RATIOS_3_HALF_1, rollout_rs="sequence",
                      rollout_rs_threshold=1.4)[0].tolist() == [[0.0, 0.0, 0.0, 1.0]]
    # geometric: 1.5 ** (1/3) = 1.145 within [1/1.2, 1.2], not within [1/1.1, 1.1]
    assert correction(**RATIOS_3_HALF_1, rollout_rs="geometric", rollout_rs_threshold=1.2)[0].tolist() == [[1.0] * 4]
    assert correction(**RATIOS_3_HALF_1, rollout_rs="geometric",
                      rollout_rs_threshold=1.1)[0].tolist() == [[0.0, 0.0, 0.0, 1.0]]


def test_verls_divergence_rejections_and_chained_criteria():
    """Log-ratios ln 3, ln 0.5, 0: k1 = -log r (-1.099, 0.693, 0), k2 = (log r)^2 / 2 (0.604, 0.240, 0),
    k3 = r - 1 - log r (0.901, 0.193, 0)."""
    def kept(rs: str, threshold) -> list[float]:
        return correction(**RATIOS_3_HALF_1, rollout_rs=rs, rollout_rs_threshold=threshold)[0][0].tolist()

    assert kept("token_k1", "0.5_2.5") == [0.0, 1.0, 1.0, 1.0]  # k1 within [ln 0.5, ln 2.5]
    assert kept("token_k2", 0.5) == [0.0, 1.0, 1.0, 1.0] and kept("token_k2", 0.2) == [0.0, 0.0, 1.0, 1.0]
    assert kept("token_k3", 0.95) == [1.0] * 4 and kept("token_k3", 0.1) == [0.0, 0.0, 1.0, 1.0]
    assert kept("seq_sum_k3", 1.2) == [1.0] * 4 and kept("seq_sum_k3", 1.0) == [0.0, 0.0, 0.0, 1.0]  # 1.094
    assert kept("seq_mean_k2", 0.3) == [1.0] * 4 and kept("seq_mean_k2", 0.25) == [0.0, 0.0, 0.0, 1.0]  # 0.281
    assert kept("seq_max_k3", 0.95) == [1.0] * 4 and kept("seq_max_k3", 0.9) == [0.0, 0.0, 0.0, 1.0]  # 0.901
    # the mean k1 is -0.135: pi_rollout / pi_old's geometric mean 0.874, outside [0.9, 1.1], inside [0.8, 1.25]
    assert kept("seq_mean_k1", "0.9_1.1") == [0.0, 0.0, 0.0, 1.0] and kept("seq_mean_k1", 1.25) == [1.0] * 4
    factors, metrics = correction(**RATIOS_3_HALF_1, rollout_rs="token_k2,seq_max_k3", rollout_rs_threshold="0.5,0.9")
    assert factors.tolist() == [[0.0, 0.0, 0.0, 1.0]]
    assert metrics["rollout_corr/rejected_frac_token_k2"].tolist() == [[1.0, 0.0, 0.0, 0.0]]
    assert metrics["rollout_corr/rejected_frac_seq_max_k3"].tolist() == [[1.0, 1.0, 1.0, 0.0]]


def test_bad_rejection_settings_name_the_key():
    from rlsys.config.layout import ParallelConfig
    from rlsys.config.loader import ConfigError
    from rlsys.rl.algorithm_checks import check_algorithm

    for rs, threshold, message in [("token_k9", 1.0, "unknown rejection 'token_k9'"),
                                   ("token_k2", "0.5_2.0", "token_k2 takes an upper bound alone"),
                                   ("token_k2,seq_sum_k3,token", "0.1,0.2", "one value for all 3 criteria"),
                                   ("token", 0.5, "token's upper bound on the ratio must be above 1"),
                                   ("token_k3", "x", "'x' is not a number")]:
        correction_cfg = RolloutCorrectionConfig(rollout_rs=rs, rollout_rs_threshold=threshold)
        algo = AlgorithmConfig(rollout_correction=correction_cfg)
        with pytest.raises(ConfigError, match=f"algorithm.rollout_correction.rollout_rs: .*{message}"):
            check_algorithm(algo, ParallelConfig())
    with pytest.raises(ValueError, match="rollout_is_batch_normalize: normalises the importance weights"):
        RolloutCorrectionConfig(rollout_is_batch_normalize=True)


def test_veto_drops_a_response_and_corrections_compose():
    # the ratio of 0.5 is below a veto of 0.6: the whole response goes; above 0.4 it stays
    assert correction(**RATIOS_3_HALF_1, rollout_token_veto_threshold=0.6)[0].tolist() == [[0.0, 0.0, 0.0, 1.0]]
    assert correction(**RATIOS_3_HALF_1, rollout_token_veto_threshold=0.4)[0].tolist() == [[1.0] * 4]
    # truncated weights times the token mask: 2 x 0 (rejected), 0.5 x 1, 1 x 1
    factors, metrics = correction(**RATIOS_3_HALF_1, rollout_is="token", rollout_rs="token", rollout_rs_threshold=2.0)
    assert torch.allclose(factors, torch.tensor([[0.0, 0.5, 1.0, 1.0]]))
    assert set(metrics) == {"rollout_corr/is_weight", "rollout_corr/truncated_frac", "rollout_corr/rejected_frac"}


def test_mismatch_metrics_by_hand():
    from rlsys.algorithms.rollout_correction import mismatch_metrics

    engine = torch.zeros(4)
    logs = [math.log(3.0), math.log(0.6), 0.0, 0.0]  # ratios 3, 0.6, 1, 1
    got = mismatch_metrics(torch.tensor(logs), engine)
    assert got["rollout/logprob_abs_diff"] == pytest.approx(sum(abs(x) for x in logs) / 4)
    assert got["mismatch/kl_k1"] == pytest.approx(-sum(logs) / 4)
    assert got["mismatch/kl_k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in logs) / 4)
    assert got["mismatch/abs_log_ratio_max"] == pytest.approx(math.log(3.0))
    assert got["mismatch/abs_log_ratio_p50"] == pytest.approx(-math.log(0.6) / 2)  # between 0 and |log 0.6|
    assert got["mismatch/ratio_outside_2x_frac"] == pytest.approx(1 / 4)  # the 3
    assert mismatch_metrics(torch.zeros(0), torch.zeros(0)) == {}
    # two responses (3 tokens and 1), VeRL's sequence diagnostics: trainer log-probs, engine's
    trainer, engine = torch.tensor([-1.0, -2.0, -3.0, -0.5]), torch.tensor([-1.5, -2.0, -2.5, -1.0])
    got = mismatch_metrics(trainer, engine, [3, 0, 1])  # a response without tokens is skipped
    trainer_means, engine_means = [-2.0, -0.5], [-2.0, -1.0]
    diffs = [e - t for e, t in zip(engine_means, trainer_means)]  # 0, -0.5
    assert got["mismatch/training_ppl"] == pytest.approx((math.exp(2.0) + math.exp(0.5)) / 2)
    assert got["mismatch/rollout_log_ppl"] == pytest.approx(1.5)
    assert got["mismatch/log_ppl_diff"] == pytest.approx(-0.25) and got["mismatch/log_ppl_diff_min"] == -0.5
    assert got["mismatch/log_ppl_abs_diff"] == pytest.approx(0.25)
    assert got["mismatch/ppl_ratio"] == pytest.approx(sum(math.exp(d) for d in diffs) / 2)
    log_ratios = [0.5, 0.0, -0.5, 0.5]
    assert got["mismatch/chi2_token"] == pytest.approx(sum(math.exp(2 * x) for x in log_ratios) / 4 - 1)
    assert got["mismatch/chi2_seq"] == pytest.approx((math.exp(0.0) + math.exp(1.0)) / 2 - 1)


def test_rollout_is_weights_each_tokens_policy_gradient():
    """With rollout log-probs the loss and its gradient are the per-token loss times the
    truncated weights, and the weights are logged."""
    from rlsys.algorithms.actor_loss import ActorInputs, actor_loss
    from rlsys.algorithms.lm_loss import logprobs_of_labels

    torch.manual_seed(0)
    batch = rl_batch()
    logits = torch.randn(2, batch["input_ids"].shape[1], 16, requires_grad=True)
    current = torch.nn.functional.pad(logprobs_of_labels(logits, batch["input_ids"]).detach(), (1, 0))
    # the engine made row 0's second token 3x less likely than the trainer, its third 2x likelier
    rollout = current - torch.tensor([[0.0, 0.0, 0.0, math.log(3.0), math.log(0.5)], [0.0] * 5])
    algo = AlgorithmConfig(rollout_correction=RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0))
    counts = {"tokens": 4, "sequences": 2}
    out = actor_loss(counts, algo, ActorInputs(rollout_logprobs=True))(logits, {**batch, "rollout_logprobs": rollout})
    plain = actor_loss(counts, AlgorithmConfig())(logits, batch)
    # on-policy: the ratio is 1, so each token's loss is -A; row 0's three tokens weigh 1, 2 and 0.5
    assert plain.loss.item() == pytest.approx((-1.0 * 3 + 2.0) / 4)
    assert out.loss.item() == pytest.approx((-1.0 * (1 + 2 + 0.5) + 2.0) / 4)
    assert out.metrics["rollout_corr/is_weight"].item() == pytest.approx((1 + 2 + 0.5 + 1) / 4)
    assert out.metrics["rollout_corr/truncated_frac"].item() == pytest.approx(1 / 4)


def test_log_probs_and_entropy_are_those_of_the_sampling_temperature():
    from rlsys.algorithms.actor_loss import actor_loss
    from rlsys.algorithms.lm_loss import token_logprobs

    torch.manual_seed(0)
    batch = rl_batch()
    logits = torch.randn(2, batch["input_ids"].shape[1], 16)
    at_07 = token_logprobs(0.7)(logits, batch).rows["logprobs"]
    assert torch.allclose(at_07, token_logprobs(1.0)(logits / 0.7, batch).rows["logprobs"])
    assert not torch.allclose(at_07, token_logprobs(1.0)(logits, batch).rows["logprobs"])
    assert torch.equal(token_logprobs(0.0)(logits, batch).rows["logprobs"],
                       token_logprobs(1.0)(logits, batch).rows["logprobs"])  # greedy: the raw logits
    counts = {"tokens": 4, "sequences": 2}
    scaled = actor_loss(counts, AlgorithmConfig(), temperature=0.7)(logits, batch)
    reference = actor_loss(counts, AlgorithmConfig())(logits / 0.7, batch)
    assert scaled.metrics["actor/entropy"].item() == pytest.approx(reference.metrics["actor/entropy"].item())
    assert torch.equal(scaled.rows["logprobs"], reference.rows["logprobs"])


def test_dapo_mixed_groups_and_overlong_penalty():
    from rlsys.algorithms.dapo import mixed_groups, overlong_penalty

    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.0, 0.0])
    assert mixed_groups(scores, 2).tolist() == [False, True, False, False]
    assert mixed_groups(scores, 4).tolist() == [True, True]
    # budget 10, buffer 4: no penalty up to 6 tokens, then -factor x (length - 6) / 4
    penalty = overlong_penalty(torch.tensor([3, 6, 7, 10]), max_new_tokens=10, buffer_len=4, factor=1.0)
    assert penalty.tolist() == [0.0, 0.0, -0.25, -1.0]


def test_kl_in_reward_with_fixed_and_adaptive_coefficients():
    from rlsys.algorithms.kl import KLController, kl_in_reward
    from rlsys.config.rl import KLControlConfig

    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    logprobs = torch.tensor([[0.0, -1.0, -2.0, 0.0], [0.0, -0.5, 0.0, 0.0]])
    ref = torch.tensor([[0.0, -1.5, -1.0, float("nan")], [0.0, -1.0, 0.0, 0.0]])  # k1: 0.5, -1.0 | 0.5
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    fixed = KLController(KLControlConfig(kl_coef=0.1))
    penalised, metrics = kl_in_reward(rewards, logprobs, ref, mask, "kl", fixed)
    assert torch.allclose(penalised, torch.tensor([[0.0, -0.05, 1.1, 0.0], [0.0, -0.05, 0.0, 0.0]]))
    assert metrics["actor/reward_kl_penalty"] == pytest.approx((-0.25 + 0.5) / 2)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1 and fixed.value == 0.1
    adaptive = KLController(KLControlConfig(type="adaptive", kl_coef=0.1, target_kl=0.1, horizon=10))
    adaptive.update(current_kl=0.5, samples=5)  # error clipped to +0.2: x (1 + 0.2 x 5 / 10)
    assert adaptive.value == pytest.approx(0.11)
    adaptive.update(current_kl=0.09, samples=10)  # error -0.1: x 0.9
    assert adaptive.value == pytest.approx(0.099)
    restored = KLController(KLControlConfig(type="adaptive"))
    restored.load_state_dict(adaptive.state_dict())
    assert restored.value == adaptive.value


def test_gae_matches_a_hand_rolled_loop_over_each_response():
    """Rows of prompt, response and padding: GAE over the response tokens alone, rewards on
    every token (as with a KL penalty in the reward), against the textbook recursion."""
    from rlsys.algorithms.advantages import gae_advantages_and_returns, masked_whiten

    torch.manual_seed(0)
    inputs = rollouts()
    inputs = AdvantageInputs(inputs.token_rewards + 0.1 * torch.randn(7, 5) * inputs.response_mask,
                             inputs.response_mask, inputs.group_ids, torch.randn(7, 5))
    gamma, lam = 0.9, 0.8
    advantages, returns = gae_advantages_and_returns(inputs, gamma, lam)
    for row in range(7):
        positions = inputs.response_mask[row].nonzero().flatten().tolist()
        rewards = inputs.token_rewards[row, positions].tolist()
        values = inputs.values[row, positions].tolist()
        expected, running = [0.0] * len(positions), 0.0
        for i in reversed(range(len(positions))):
            following = values[i + 1] if i + 1 < len(positions) else 0.0
            running = rewards[i] + gamma * following - values[i] + gamma * lam * running
            expected[i] = running
        assert advantages[row, positions].tolist() == pytest.approx(expected, abs=1e-6)
        assert returns[row, positions].tolist() == pytest.approx([a + v for a, v in zip(expected, values)], abs=1e-6)
    outside = inputs.response_mask == 0
    assert (advantages[outside] == 0).all() and (returns[outside] == 0).all()
    whitened = compute_advantages(inputs, AlgorithmConfig(adv_estimator="gae", gamma=gamma, lam=lam))
    assert torch.allclose(whitened, masked_whiten(advantages, inputs.response_mask) * inputs.response_mask)


def test_value_loss_clips_each_prediction_around_the_old_value():
    from rlsys.algorithms.value_loss import value_loss

    # one response of 3 tokens after a 1-token prompt; predictions are read one position earlier
    batch = {"input_ids": torch.tensor([[1, 2, 3, 4]]), "loss_mask": torch.tensor([[0.0, 1.0, 1.0, 1.0]]),
             "values": torch.tensor([[0.0, 0.0, 0.0, 1.0]]), "returns": torch.tensor([[0.0, 1.0, 1.0, 1.0]])}
    predicted = torch.tensor([[[0.4], [2.0], [1.0], [9.0]]])  # the last position predicts nothing
    out = value_loss({"tokens": 3, "sequences": 1}, cliprange=0.5, loss_agg="token-mean")(predicted, batch)
    # token 1: v 0.4 (within 0.5 of 0): 0.36; token 2: v 2.0, clipped 0.5: max(1, 0.25) = 1;
    # token 3: v 1.0, old 1.0: 0
    assert out.loss.item() == pytest.approx(0.5 * (0.36 + 1.0 + 0.0) / 3)
    assert out.metrics["critic/vf_clipfrac"].item() == pytest.approx(0.0)
    out = value_loss({"tokens": 3, "sequences": 1}, cliprange=0.5, loss_agg="token-mean")(
        torch.tensor([[[3.0], [2.0], [1.0], [0.0]]]), batch)  # token 1: v 3.0, clipped 0.5: max(4, 0.25)
    assert out.loss.item() == pytest.approx(0.5 * (4.0 + 1.0 + 0.0) / 3)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae"])
def test_a_tool_turn_inside_a_response_is_skipped_not_a_cut(estimator):
    """Multi-turn rows (sampled turn, tool turn masked out, sampled turn): every estimator gives
    a row's sampled tokens of both turns what it gives the same tokens without the tool turn
    between them, and the tool turn nothing; the actor loss and its metrics likewise."""
    from rlsys.algorithms.actor_loss import ActorInputs, actor_loss

    torch.manual_seed(0)
    plain_mask = torch.tensor([[0, 1, 1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 0, 0, 0, 0]], dtype=torch.float32)
    turns_mask = torch.tensor([[0, 1, 1, 0, 0, 0, 1, 1], [0, 1, 0, 0, 0, 1, 1, 0]], dtype=torch.float32)
    tool = (turns_mask == 0) & (torch.arange(8) > 0) & (torch.arange(8) < torch.tensor([[8], [7]]))

    def rows(mask: torch.Tensor) -> tuple[AdvantageInputs, torch.Tensor]:
        last = mask.shape[1] - 1 - mask.flip(1).argmax(1)
        rewards = torch.zeros_like(mask)
        rewards[torch.arange(2), last] = torch.tensor([1.0, 0.2])
        values = torch.zeros_like(mask)
        values[mask.bool()] = torch.linspace(0.1, 0.7, int(mask.sum()))
        return AdvantageInputs(rewards, mask, torch.tensor([0, 0]), values), mask.bool()

    algo = AlgorithmConfig(adv_estimator=estimator, gamma=0.9, lam=0.8)
    (plain, plain_sampled), (turns, turns_sampled) = rows(plain_mask), rows(turns_mask)
    plain_advantages, turns_advantages = compute_advantages(plain, algo), compute_advantages(turns, algo)
    assert turns_advantages[turns_sampled].tolist() == pytest.approx(plain_advantages[plain_sampled].tolist(), abs=1e-6)
    assert (turns_advantages[tool] == 0).all()

    logits = torch.randn(2, 8, 11)
    ids = torch.randint(0, 11, (2, 8))
    loss = actor_loss({"tokens": 6, "sequences": 2, "horizon": 8}, AlgorithmConfig(kl_coef=0.1),
                      ActorInputs(ref_logprobs=True))
    batch = {"input_ids": ids, "loss_mask": turns_mask, "advantages": turns_advantages,
             "ref_logprobs": torch.full((2, 8), -2.0)}
    with_tool_garbage = {**batch, "advantages": torch.where(tool, torch.nan, turns_advantages),
                         "ref_logprobs": torch.where(tool, torch.nan, batch["ref_logprobs"])}
    out, garbage = loss(logits, batch), loss(logits, with_tool_garbage)
    assert out.loss.item() == pytest.approx(garbage.loss.item()) and math.isfinite(out.loss.item())
    metrics = {k: v.item() for k, v in out.metrics.items()}
    assert metrics == pytest.approx({k: v.item() for k, v in garbage.metrics.items()})


def test_distillation_reverse_kl_by_hand():
    """log pi - log teacher at each response token, 0 off the mask; token means over the batch.
    As an advantage (mode: advantage) a token the teacher likes more than the policy is pushed up."""
    from rlsys.algorithms.distill import reverse_kl

    policy = torch.tensor([[0.0, -1.0, -0.5, -2.0], [0.0, -0.2, -3.0, 9.0]])
    teacher = torch.tensor([[0.0, -1.5, -0.1, -2.0], [0.0, -1.2, -1.0, float("nan")]])
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0]])
    kl, metrics = reverse_kl(policy, teacher, mask)
    expected = torch.tensor([[0.0, 0.5, -0.4, 0.0], [0.0, 1.0, -2.0, 0.0]])
    assert torch.allclose(kl, expected)
    assert metrics["distill/reverse_kl"] == pytest.approx((0.5 - 0.4 + 0.0 + 1.0 - 2.0) / 5)
    assert metrics["distill/teacher_logprob_mean"] == pytest.approx((-1.5 - 0.1 - 2.0 - 1.2 - 1.0) / 5)
    assert metrics["distill/policy_logprob_mean"] == pytest.approx((-1.0 - 0.5 - 2.0 - 0.2 - 3.0) / 5)
    advantages = -1.0 * kl
    assert advantages[1, 2] == 2.0 and advantages[0, 1] == -0.5


def test_top_k_distillation_loss_is_the_teachers_forward_kl_over_its_top_k():
    """The actor loss with the teacher's top-k tokens adds coef x sum_j p_t(j) (log p_t(j) - log pi(j))
    at each response token, at temperature 1 whatever the rollout's: over the whole vocabulary (k = V)
    it is the exact KL(teacher || pi), and its gradient is coef x (pi - p_t) / tokens on the logits.
    Off the mask (the prompt, padding) the teacher's fields are never read."""
    from rlsys.algorithms.actor_loss import ActorInputs, actor_loss
    from rlsys.algorithms.distill import TOP_IDS, TOP_LOGPROBS
    from rlsys.config.rl import DistillConfig

    vocab, k = 7, 7
    logits = torch.randn(2, 5, vocab, requires_grad=True)
    ids = torch.randint(0, vocab, (2, 5))
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]], dtype=torch.float32)
    teacher = torch.randn(2, 5, vocab).log_softmax(-1)
    top_logprobs, top_ids = teacher.topk(k, dim=-1)
    top_logprobs = torch.where(mask.bool()[..., None], top_logprobs, torch.nan)  # garbage off the mask
    batch = {"input_ids": ids, "loss_mask": mask, "advantages": torch.zeros(2, 5),
             TOP_IDS: top_ids, TOP_LOGPROBS: top_logprobs}
    algo = AlgorithmConfig(distill=DistillConfig(teacher="t", top_k=k, coef=0.5))
    top_k = ActorInputs(teacher_top_k=True)
    out = actor_loss({"tokens": 5, "sequences": 2, "horizon": 4}, algo, top_k, temperature=0.7)(logits, batch)
    policy = logits[:, :-1].log_softmax(-1)
    exact = (teacher[:, 1:].exp() * (teacher[:, 1:] - policy)).sum(-1)
    on = mask[:, 1:].bool()
    assert out.loss.item() == pytest.approx(0.5 * exact[on].sum().item() / 5, abs=1e-5)
    assert out.metrics["distill/top_k_kl"].item() == pytest.approx(exact[on].mean().item(), abs=1e-5)
    assert out.metrics["distill/teacher_top_k_mass"].item() == pytest.approx(1.0, abs=1e-5)
    out.loss.backward()
    expected = 0.5 * (policy.exp() - teacher[:, 1:].exp()) * on[..., None] / 5
    assert torch.allclose(logits.grad[:, :-1], expected, atol=1e-6)
    assert (logits.grad[:, -1] == 0).all()

    # k = 2 of 7: only the teacher's two likeliest tokens, neither side renormalised
    top2, ids2 = teacher.topk(2, dim=-1)
    out2 = actor_loss({"tokens": 5, "sequences": 2, "horizon": 4}, algo, top_k)(
        logits.detach(), {**batch, TOP_IDS: ids2, TOP_LOGPROBS: top2})
    kl2 = (top2[:, 1:].exp() * (top2[:, 1:] - policy.detach().gather(-1, ids2[:, 1:]))).sum(-1)
    assert out2.metrics["distill/top_k_kl"].item() == pytest.approx(kl2[on].mean().item(), abs=1e-5)
    assert out2.metrics["distill/teacher_top_k_mass"].item() < 1


def test_bradley_terry_by_hand():
    """Rows pair up (chosen, rejected); a row's score is its value at the one token its loss mask
    marks; the loss is -log sigmoid(chosen - rejected), summed and divided by the step's pairs."""
    from rlsys.algorithms.preference_loss import bradley_terry_loss

    values = torch.tensor([[0.0, 2.0, 9.0], [0.0, 0.5, 0.0], [1.0, -1.0, 7.0], [0.0, 3.0, 0.0]])
    mask = torch.tensor([[0, 1, 0], [0, 1, 0], [0, 1, 0], [0, 0, 1]])
    out = bradley_terry_loss(num_pairs=4)(values[..., None], {"loss_mask": mask})
    margins = torch.tensor([2.0 - 0.5, -1.0 - 0.0])
    assert out.loss.item() == pytest.approx((-torch.nn.functional.logsigmoid(margins)).sum().item() / 4)
    assert out.metrics["rm/accuracy"].item() == pytest.approx(1 / 4)
    assert out.metrics["rm/margin"].item() == pytest.approx(0.5 / 4)


def test_an_episodes_segments_share_its_advantage_and_its_token_rewards_count_once():
    """Rows 0-1 are one episode (two segments), row 2 another, in one group: the estimator sees two
    episodes whose scores are every segment's token rewards (a penalty of -0.5 on the first segment,
    the outcome 1 on the second), and the first segment takes the episode's advantage; rloo's
    baseline is the other episode, not the other segment."""
    from rlsys.algorithms.advantages import episode_advantages

    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 1.0, 1.0], [0.0, 1.0, 1.0, 1.0]])
    rewards = torch.tensor([[0.0, -0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    inputs = AdvantageInputs(rewards, mask, torch.tensor([0, 0, 0]))
    result = episode_advantages(inputs, torch.tensor([0, 0, 1]), AlgorithmConfig(adv_estimator="rloo"))
    assert torch.allclose(result, torch.tensor([0.5, 0.5, -0.5]).unsqueeze(1) * mask)
    plain = episode_advantages(inputs, torch.tensor([0, 1, 2]), AlgorithmConfig(adv_estimator="rloo"))
    assert torch.equal(plain, compute_advantages(inputs, AlgorithmConfig(adv_estimator="rloo")))


def test_bypass_mode_corrects_the_ratio_of_the_policy_being_updated():
    """VeRL's bypass mode: the old log-probs are the engine's. With ppo_clip the loss is PPO-clip of
    pi / pi_rollout (no importance weight on top) with rejections against the current policy; with
    reinforce it is -w A log pi, w the truncated weight pi / pi_rollout, as VeRL's
    compute_policy_loss_bypass_mode computes them."""
    from rlsys.algorithms.actor_loss import ActorInputs, actor_loss
    from rlsys.algorithms.lm_loss import logprobs_of_labels

    torch.manual_seed(0)
    batch = rl_batch()
    logits = torch.randn(2, batch["input_ids"].shape[1], 16, requires_grad=True)
    current = torch.nn.functional.pad(logprobs_of_labels(logits, batch["input_ids"]).detach(), (1, 0))
    # the engine found row 0's second token 3x less likely than the current policy does, its third 2x likelier
    rollout = current - torch.tensor([[0.0, 0.0, 0.0, math.log(3.0), math.log(0.5)], [0.0] * 5])
    bypass = {**batch, "old_logprobs": rollout, "rollout_logprobs": rollout}
    counts, engine_old = {"tokens": 4, "sequences": 2}, ActorInputs(old_logprobs=True, rollout_logprobs=True)

    clip = AlgorithmConfig(rollout_correction=RolloutCorrectionConfig(preset="bypass_ppo_clip"))
    vanilla = actor_loss(counts, AlgorithmConfig(), ActorInputs(old_logprobs=True))(
        logits, {**batch, "old_logprobs": rollout})
    assert actor_loss(counts, clip, engine_old)(logits, bypass).loss.item() == pytest.approx(vanilla.loss.item())
    # seq_mean_k3 rejects row 0 (its mean k3 is (0 + 2 - log 3 + 0.5 - log 0.5) / 3 = 0.4) above 0.01
    k3 = AlgorithmConfig(rollout_correction=RolloutCorrectionConfig(preset="bypass_ppo_clip_k3_rs"))
    out = actor_loss(counts, k3, engine_old)(logits, bypass)
    assert out.loss.item() == pytest.approx(2.0 / 4)  # row 1's token alone: ratio 1, -A = 2
    assert out.metrics["rollout_corr/rejected_frac"].item() == pytest.approx(3 / 4)

    reinforce = AlgorithmConfig(rollout_correction=RolloutCorrectionConfig(preset="bypass_pg_is"))
    out = actor_loss(counts, reinforce, engine_old)(logits, bypass)
    logp = current[:, 1:][batch["loss_mask"][:, 1:].bool()]  # row 0's three tokens, then row 1's
    w = min(3.0 * 0.5, 2.0)  # row 0's sequence weight: the product of its ratios, truncated at 2
    assert out.loss.item() == pytest.approx((-1.0 * w * logp[:3].sum() + 2.0 * logp[3]).item() / 4, rel=1e-5)
    out.loss.backward()
    expected = logits.grad.clone()
    logits.grad = None
    by_hand = -(torch.tensor([w, w, w, 1.0]) * torch.tensor([1.0, 1.0, 1.0, -2.0])
                * logprobs_of_labels(logits, batch["input_ids"])[batch["loss_mask"][:, 1:].bool()]).sum() / 4
    by_hand.backward()
    assert torch.allclose(logits.grad, expected, atol=1e-6)


def test_the_optimal_token_baseline_weights_each_response_by_its_path_variance():
    """Two responses to one prompt, each of two sampled tokens (the first column is the prompt's):
    w = 1 - 2 pi + sum(pi^2) is 0.5 a token for the first and 1.5 for the second, so their
    cumulative W are [0.5, 1] and [1.5, 3], and the baseline of the returns [1, 1] and [0, 0] is
    [0.5 / 2, 1 / 4]; the multi-turn variant counts sampled tokens only, so a tool token between the
    second's two gives the same."""
    half = math.log(0.5)
    old = torch.tensor([[0.0, half, half], [0.0, half, half]])
    sum_pi_squared = torch.tensor([[0.0, 0.5, 0.5], [0.0, 1.5, 1.5]])
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    inputs = AdvantageInputs(rewards, mask, torch.tensor([7, 7]), old_logprobs=old, sum_pi_squared=sum_pi_squared)
    expected = torch.tensor([[0.0, 0.75, 0.75], [0.0, -0.25, -0.25]])
    assert torch.allclose(compute_advantages(inputs, AlgorithmConfig(adv_estimator="optimal_token_baseline")),
                          expected)
    tool = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, 1.0]])
    spread = lambda x: torch.stack([torch.cat([x[0], x[0, :1]]), torch.stack([x[1, 0], x[1, 1], x[1, 0], x[1, 2]])])  # noqa: E731
    tir = AdvantageInputs(spread(rewards), tool, torch.tensor([7, 7]), old_logprobs=spread(old),
                          sum_pi_squared=spread(sum_pi_squared))
    got = compute_advantages(tir, AlgorithmConfig(adv_estimator="tir_optimal_token_baseline"))
    assert torch.allclose(got, spread(expected) * tool)


def test_remax_subtracts_the_greedy_responses_score():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.5, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    inputs = AdvantageInputs(rewards, mask, torch.tensor([0, 1]), reward_baselines=torch.tensor([0.25, 1.0]))
    result = compute_advantages(inputs, AlgorithmConfig(adv_estimator="remax"))
    assert torch.allclose(result, torch.tensor([[0.0, 0.75, 0.75], [-0.5, -0.5, 0.0]]))


def test_the_passes_follow_what_the_extensions_declare():
    """Which trainer passes a step runs follows from its features' declared needs: on-policy GRPO none
    (the update's own forward), KL in the reward an old pass and the reference, KL in the loss the
    reference alone; an extension needing what no pass gives is refused by name."""
    from rlsys.config.schema import RLJobConfig
    from rlsys.rl.extension import StepExtension
    from rlsys.rl.features import Features, features_of
    from rlsys.rl.passes import needs_reference, old_logprobs_source

    def job(**algorithm) -> RLJobConfig:
        return RLJobConfig(model={"path": "m"}, data={"train_files": ["x"]}, reward={"terms": [{"name": "arith"}]},
                           algorithm=algorithm)

    grpo, in_reward, in_loss = job(), job(use_kl_in_reward=True), job(kl_coef=0.01)
    assert features_of(grpo).needs == frozenset()
    assert (old_logprobs_source(grpo), needs_reference(grpo)) == ("current", False)
    assert (old_logprobs_source(in_reward), needs_reference(in_reward)) == ("trainer", True)
    assert (old_logprobs_source(in_loss), needs_reference(in_loss)) == ("current", True)

    class Typo(StepExtension):
        needs = frozenset({"old_logprob"})

    with pytest.raises(ValueError, match=r"Typo needs \['old_logprob'\]: the passes give old_logprobs"):
        Features([Typo()])
