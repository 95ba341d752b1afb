"""GRPO advantages, the clipped loss, KL estimators and aggregation against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from rlsys.algorithms.grpo import grpo_advantages
from rlsys.algorithms.policy_loss import aggregate, kl_penalty, ppo_clip_loss


def test_grpo_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    # group 0: mean 0.5, unbiased std sqrt(1/3); group 1: constant -> 0
    std = math.sqrt((4 * 0.25) / 3)
    expected = torch.tensor([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std, 0.0, 0.0])
    assert torch.allclose(grpo_advantages(rewards, groups), expected, atol=1e-5)
    assert torch.allclose(grpo_advantages(rewards, groups, norm_by_std=False),
                          torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0]))


def test_clipped_loss_by_hand():
    old = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5]))
    new = torch.log(torch.tensor([0.75, 0.25, 0.75, 0.55]))  # ratios 1.5, 0.5, 1.5, 1.1
    adv = torch.tensor([1.0, -1.0, -1.0, 2.0])
    loss, clipped = ppo_clip_loss(new, old, adv, clip_low=0.2, clip_high=0.28)
    # A>0, r=1.5 -> clipped at 1.28: -1.28.  A<0, r=0.5 -> max(0.5, 0.8) = 0.8 (clipped).
    # A<0, r=1.5 -> max(1.5, 1.28) = 1.5 (unclipped).  A>0, r=1.1 inside: -2.2.
    assert torch.allclose(loss, torch.tensor([-1.28, 0.8, 1.5, -2.2]), atol=1e-5)
    assert clipped.tolist() == [1.0, 1.0, 0.0, 0.0]


def test_kl_estimators_match_their_formulas():
    p = torch.tensor([0.3, 0.6, 0.9])
    q = torch.tensor([0.5, 0.6, 0.2])
    logp, logq = p.log(), q.log()
    assert torch.allclose(kl_penalty(logp, logq, "k1"), (p / q).log())
    assert torch.allclose(kl_penalty(logp, logq, "k2"), 0.5 * (p / q).log() ** 2)
    assert torch.allclose(kl_penalty(logp, logq, "k3"), q / p - 1 - (q / p).log())
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
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert aggregate(per_token, mask, "token-mean", 4, 2).item() == pytest.approx(10 / 4)
    assert aggregate(per_token, mask, "seq-mean-token-mean", 4, 2).item() == pytest.approx((2 + 4) / 2)
    assert aggregate(per_token, mask, "seq-mean-token-sum", 4, 2).item() == pytest.approx((6 + 4) / 2)
    # split into two micro-batches, the shares add up to the whole
    halves = [aggregate(per_token[i:i + 1], mask[i:i + 1], "seq-mean-token-mean", 4, 2) for i in (0, 1)]
    assert sum(halves).item() == pytest.approx(3.0)


def test_on_policy_loss_equals_the_loss_with_recomputed_old_logprobs():
    """With no old_logprobs the policy loss takes the current ones, detached: the loss,
    gradient and log-prob rows equal those of a separate pass's old log-probs."""
    from rlsys.algorithms.lm_loss import logprobs_of_labels
    from rlsys.algorithms.rl_step import policy_loss
    from rlsys.config.schema import AlgorithmConfig
    from rlsys.data.batching import collate_rollouts, on_response_tokens, per_token

    torch.manual_seed(0)
    batch = collate_rollouts([[1, 2], [3, 4, 5]], [[6, 7, 8], [9]], pad_id=0)
    batch["advantages"] = per_token(torch.tensor([1.0, -2.0]), batch)
    logits = torch.randn(2, batch["input_ids"].shape[1], 16, requires_grad=True)
    counts = {"tokens": 4, "sequences": 2}
    loss_fn = policy_loss(counts, AlgorithmConfig(clip_ratio_low=0.2, clip_ratio_high=0.28))

    on_policy = loss_fn(logits, batch)
    (grad_on_policy,) = torch.autograd.grad(on_policy.loss, logits)
    old = torch.nn.functional.pad(logprobs_of_labels(logits, batch["input_ids"]).detach(), (1, 0))
    recomputed = loss_fn(logits, {**batch, "old_logprobs": old})
    (grad_recomputed,) = torch.autograd.grad(recomputed.loss, logits)

    assert on_policy.loss.item() == pytest.approx(recomputed.loss.item())
    assert grad_on_policy.abs().sum() > 0 and torch.allclose(grad_on_policy, grad_recomputed)
    assert torch.equal(on_policy.rows["logprobs"], old)
    # the engine's per-token values land on the response tokens, in row order
    placed = on_response_tokens(torch.tensor([0.1, 0.2, 0.3, 0.4]), batch)
    assert torch.allclose(placed * batch["loss_mask"], placed)
    assert torch.allclose(placed[0, 2:5], torch.tensor([0.1, 0.2, 0.3])) and placed[1, 3].item() == pytest.approx(0.4)
