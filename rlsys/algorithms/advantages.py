"""Advantage estimators, chosen by name (`algorithm.adv_estimator`), with VeRL's semantics.

An estimator sees a step's responses as VeRL's do: per-token rewards [N, T] (a
response's score on its last token), the response mask [N, T] and each response's
group id (VeRL's `uid`: the responses sampled for one prompt draw, not row order),
and returns per-token advantages [N, T], 0 outside responses. A user's own
estimator registers with `@register_advantage("name")` in a file listed under
`algorithm.extensions`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlsys.config.rl import AlgorithmConfig
from rlsys.registry import Registry


@dataclass(frozen=True)
class AdvantageInputs:
    token_rewards: torch.Tensor
    """[N, T] float, 0 outside responses."""
    response_mask: torch.Tensor
    """[N, T], 1 on response tokens."""
    group_ids: torch.Tensor
    """[N] int: responses to the same prompt draw share an id."""
    values: torch.Tensor | None = None
    """[N, T] the critic's value of the state before each token (gae only)."""
    old_logprobs: torch.Tensor | None = None
    """[N, T] the sampling policy's log-prob of each token, from the trainer's pass (the optimal token baselines)."""
    sum_pi_squared: torch.Tensor | None = None
    """[N, T] the sum over the vocabulary of the squared next-token probabilities, from the same pass."""
    is_weights: torch.Tensor | None = None
    """[N, T] the truncated rollout importance weights, when `rollout_correction.rollout_is` is on."""
    reward_baselines: torch.Tensor | None = None
    """[N] the score of a greedy response to each response's prompt (remax)."""

    def rows(self, index: torch.Tensor) -> AdvantageInputs:
        """These inputs for the rows `index` only."""
        return AdvantageInputs(*(None if value is None else value[index] for value in
                                 (getattr(self, f.name) for f in dataclasses.fields(self))))


AdvantageFn = Callable[[AdvantageInputs, AlgorithmConfig], torch.Tensor]
ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator")


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    return lambda fn: ADVANTAGES.register(name, fn)


def compute_advantages(inputs: AdvantageInputs, algo: AlgorithmConfig) -> torch.Tensor:
    return ADVANTAGES[algo.adv_estimator](inputs, algo)


def episode_ends(episodes: torch.Tensor) -> torch.Tensor:
    """[N] bool: the rows that end their episode (`episodes`: each row's episode, its rows consecutive)."""
    ends = torch.ones_like(episodes, dtype=torch.bool)
    ends[:-1] = episodes[1:] != episodes[:-1]
    return ends


def episode_advantages(inputs: AdvantageInputs, episodes: torch.Tensor, algo: AlgorithmConfig) -> torch.Tensor:
    """Advantages of rows that are the segments of episodes (`episodes`: each row's episode, 0, 1, ...,
    its rows consecutive, the last the one its reward is on). The estimator sees one row per episode,
    its last segment, with the token rewards of the earlier segments (a KL or teacher penalty) added on
    its last response token, so the group baseline counts episodes; each earlier segment takes the
    advantage of its episode's first sampled token on its own response tokens: an outcome estimator
    (grpo, rloo, ...) gives every segment of an episode the same advantage."""
    ends = episode_ends(episodes)
    if ends.all():
        return compute_advantages(inputs, algo)
    last, mask = ends.nonzero().squeeze(1), inputs.response_mask.float()
    rewards = inputs.token_rewards[last].clone()
    earlier = torch.zeros(len(last)).index_add_(0, episodes, (inputs.token_rewards * mask).sum(-1)) \
        - (rewards * mask[last]).sum(-1)
    rows = torch.arange(len(last))
    rewards[rows, mask.shape[1] - 1 - mask[last].flip(1).argmax(1)] += earlier
    per_episode = compute_advantages(dataclasses.replace(inputs.rows(last), token_rewards=rewards), algo)
    first_token = per_episode[rows, mask[last].argmax(1)]
    advantages = first_token[episodes].unsqueeze(1) * mask
    advantages[last] = per_episode
    return advantages


@register_advantage("grpo")
def grpo(inputs: AdvantageInputs, algo: AlgorithmConfig) -> torch.Tensor:
    """(score - group mean) / (group std + 1e-6) on every response token; without
    `norm_adv_by_std`, Dr. GRPO's score - group mean. The std is the unbiased one. A group
    of one keeps its raw score (mean 0, std 1), as in VeRL."""
    scores = _scores(inputs)
    mean, std, size = _group_stats(scores, inputs.group_ids)
    alone = size == 1
    advantages = scores - torch.where(alone, 0.0, mean)
    if algo.norm_adv_by_std:
        advantages = advantages / (torch.where(alone, 1.0, std) + 1e-6)
    return _on_responses(advantages, inputs)


@register_advantage("grpo_passk")
def grpo_passk(inputs: AdvantageInputs, algo: AlgorithmConfig) -> torch.Tensor:
    """Pass@k GRPO: only each group's best response gets an advantage, its score minus the group's
    second best (over the group's unbiased std + 1e-6 with `norm_adv_by_std`); of tied best
    responses, the one torch.topk returns first, as in VeRL. A group of one (its other samples
    dropped) gets 0, where VeRL raises."""
    scores = _scores(inputs)
    advantages = torch.zeros_like(scores)
    for members in _groups(inputs.group_ids):
        group = scores[members]
        if len(members) < 2:
            continue
        (best, second), (first, _) = torch.topk(group, 2)
        advantage = best - second
        advantages[members[first]] = advantage / (group.std() + 1e-6) if algo.norm_adv_by_std else advantage
    return _on_responses(advantages, inputs)


@register_advantage("opo")
def opo(inputs: AdvantageInputs, algo: AlgorithmConfig) -> torch.Tensor:
    """OPO: score minus the group's length-weighted mean score (sum of length x score over sum of
    lengths), the optimal baseline under on-policy updates; a group of one keeps its score."""
    scores = _scores(inputs)
    lengths = inputs.response_mask.sum(-1).float()
    baseline = torch.zeros_like(scores)
    for members in _groups(inputs.group_ids):
        if len(members) > 1:
            weights = lengths[members]
            baseline[members] = (weights * scores[members]).sum() / weights.sum()
    return _on_responses(scores - baseline, inputs)


@register_advantage("gpg")
def gpg(inputs: AdvantageInputs, algo: AlgorithmConfig) -> torch.Tensor:
    """GPG: alpha x (score - group mean), alpha the batch's responses over those with a non-zero
    score (how much of the batch carries a gradient); a group of one keeps alpha x its score."""
    scores = _scores(inputs)
    mean, _, size = _group_stats(scores, inputs.group_ids)
    alpha = len(scores) / torch.count_nonzero(scores).clamp(min=1)
    return _on_responses(alpha * (scores - torch.where(size == 1, 0.0, mean)), inputs)


@register_advantage("rloo")
def rloo(inputs: AdvantageInputs, algo: AlgorithmConfig) -> torch.Tensor:
    """REINFORCE leave-one-out: score minus the mean of the group's other responses. A group
    of one keeps its raw score."""
    scores = _scores(inputs)
    mean, _, size = _group_stats(scores, inputs.group_ids)
    others = size.clamp(min=2) - 1
    advantages = torch.where(size == 1, scores, (scores * size - mean * size) / others)
    return _on_responses(advantages, inputs)


@register_advantage("remax")
def remax(inputs: AdvantageInputs, algo: AlgorithmConfig) -> torch.Tensor:
    """ReMax ([Li et al. 2023](https://arxiv.org/abs/2310.10505)): the return-to-go less the score
    of the greedy response to the same prompt, which the step generates beside the samples."""
    if inputs.reward_baselines is None:
        raise ValueError("remax needs the greedy responses' scores (reward_baselines)")
    mask = inputs.response_mask.float()
    returns = _returns_to_go(inputs.token_rewards, mask)
    return (returns - inputs.reward_baselines.unsqueeze(-1)) * mask


@register_advantage("reinforce_plus_plus")
def reinforce_plus_plus(inputs: AdvantageInputs, algo: AlgorithmConfig) -> torch.Tensor:
    """REINFORCE++: the discounted return of the token rewards (`algorithm.gamma`) at every
    response token, whitened over all response tokens of the batch. Tokens outside the mask
    (the prompt, padding, a multi-turn response's tool turns) are skipped: the return runs
    through them, undiscounted, to the sampled tokens before them."""
    mask = inputs.response_mask.float()
    returns = torch.zeros_like(mask)
    running = torch.zeros(mask.shape[0])
    for t in reversed(range(mask.shape[1])):
        running = torch.where(mask[:, t] > 0, inputs.token_rewards[:, t] + algo.gamma * running, running)
        returns[:, t] = running
    return masked_whiten(returns, mask) * mask


@register_advantage("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(inputs: AdvantageInputs, algo: AlgorithmConfig) -> torch.Tensor:
    """REINFORCE++ with a group baseline: score minus its group's mean (0 for a group of one)
    on every response token, whitened over all response tokens of the batch."""
    scores = _scores(inputs)
    mean, _, size = _group_stats(scores, inputs.group_ids)
    centred = _on_responses(scores - torch.where(size == 1, 0.0, mean), inputs)
    mask = inputs.response_mask.float()
    return masked_whiten(centred, mask) * mask


@register_advantage("gae")
def gae(inputs: AdvantageInputs, algo: AlgorithmConfig) -> torch.Tensor:
    """PPO's generalised advantage estimate from the critic's values, whitened over the
    batch's response tokens."""
    advantages, _ = gae_advantages_and_returns(inputs, algo.gamma, algo.lam)
    return masked_whiten(advantages, inputs.response_mask) * inputs.response_mask


@register_advantage("optimal_token_baseline")
def optimal_token_baseline(inputs: AdvantageInputs, algo: AlgorithmConfig) -> torch.Tensor:
    """VeRL's optimal token baseline (OTB): the return-to-go G_t less a baseline per response
    position and group, B_t = sum(G_t W_t) / sum(W_t) over the group's responses, where W_t is
    the cumulative sum over the response's tokens up to t of 1 - 2 pi_j + sum(pi^2) (each times
    the squared rollout importance weight when those are on). A group of one keeps its return."""
    return _optimal_token_baseline(inputs, sampled_only=False, zero_tail=False)


@register_advantage("tir_optimal_token_baseline")
def tir_optimal_token_baseline(inputs: AdvantageInputs, algo: AlgorithmConfig) -> torch.Tensor:
    """OTB for multi-turn responses (VeRL's tool-integrated variant): positions count sampled
    tokens only (tool turns skipped), and where one response of a group is the only one that long,
    its baseline past the second-longest's length is 0."""
    return _optimal_token_baseline(inputs, sampled_only=True, zero_tail=True)


def _optimal_token_baseline(inputs: AdvantageInputs, sampled_only: bool, zero_tail: bool,
                            eps: float = 1e-8) -> torch.Tensor:
    if inputs.old_logprobs is None or inputs.sum_pi_squared is None:
        raise ValueError("the optimal token baselines need the trainer's old log-probs and sum_pi_squared")
    mask = inputs.response_mask.float()
    returns = _returns_to_go(inputs.token_rewards, mask)
    weight = 1 - 2 * inputs.old_logprobs.exp() + inputs.sum_pi_squared
    if inputs.is_weights is not None:
        weight = weight * inputs.is_weights.square()
    cumulative = torch.where(mask.bool(), weight, 0.0).cumsum(-1)  # padding may hold NaN
    index, valid = _response_positions(mask, sampled_only)
    aligned_mask = mask.gather(1, index) * valid
    aligned_returns = returns.gather(1, index) * aligned_mask
    aligned_weight = cumulative.gather(1, index) * aligned_mask
    lengths = mask.sum(-1).long()
    baselines = torch.zeros_like(aligned_returns)
    for rows in _groups(inputs.group_ids):
        if len(rows) == 1:
            continue
        baselines[rows] = ((aligned_returns[rows] * aligned_weight[rows]).sum(0)
                           / (aligned_weight[rows].sum(0) + eps))
        ranked = lengths[rows].sort().values
        longest = rows[lengths[rows] == ranked[-1]]
        if zero_tail and len(longest) == 1 and ranked[-1] > ranked[-2]:
            baselines[longest[0], int(ranked[-2]):] = 0.0
    advantages = (aligned_returns - baselines) * aligned_mask
    return torch.zeros_like(returns).scatter_add_(1, index, advantages)


def _returns_to_go(token_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N, T] each token's sum of the rewards on it and on the response tokens after it (undiscounted)."""
    return (token_rewards * mask).flip(-1).cumsum(-1).flip(-1)


def _response_positions(mask: torch.Tensor, sampled_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, T] the column of each row's j-th response position, and 1 where there is one: its
    sampled tokens in order (`sampled_only`), else every column from its first sampled token on."""
    columns = torch.arange(mask.shape[1]).expand_as(mask)
    if sampled_only:
        index = torch.sort(1 - mask, dim=1, stable=True).indices
        return index, (columns < mask.sum(-1, keepdim=True)).float()
    start = mask.argmax(1, keepdim=True)
    return (start + columns).clamp(max=mask.shape[1] - 1), (start + columns < mask.shape[1]).float()


def gae_advantages_and_returns(inputs: AdvantageInputs, gamma: float, lam: float
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE(gamma, lam) over each row's response tokens, and the returns the critic regresses
    on (advantages + values). Tokens outside the mask (the prompt, padding) are skipped:
    they neither add a TD error nor cut the recursion (VeRL's compute_gae_advantage_return)."""
    if inputs.values is None:
        raise ValueError("gae needs the critic's values")
    rewards, values, mask = inputs.token_rewards, inputs.values, inputs.response_mask.float()
    next_value = torch.zeros_like(values[:, 0])
    running = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        step = delta + gamma * lam * running
        next_value = torch.where(mask[:, t] > 0, values[:, t], next_value)
        running = torch.where(mask[:, t] > 0, step, running)
        advantages[:, t] = running
    return advantages * mask, (advantages + values) * mask


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(values - mean) / sqrt(var + 1e-8) over the masked elements (unbiased var), as VeRL's."""
    count = mask.sum()
    mean = (values * mask).sum() / count
    var = ((values - mean).square() * mask).sum() / (count - 1).clamp(min=1)
    return (values - mean) * torch.rsqrt(var + 1e-8)


def _scores(inputs: AdvantageInputs) -> torch.Tensor:
    return (inputs.token_rewards * inputs.response_mask).sum(-1).float()


def _group_stats(scores: torch.Tensor, group_ids: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each response's group mean, unbiased std (0 for a group of one) and size, [N] each."""
    _, group, size = group_ids.unique(return_inverse=True, return_counts=True)
    sums = torch.zeros(len(size)).index_add_(0, group, scores)
    mean = sums / size
    squares = torch.zeros(len(size)).index_add_(0, group, (scores - mean[group]).square())
    std = (squares / (size - 1).clamp(min=1)).sqrt()
    return mean[group], std[group], size[group]


def _groups(group_ids: torch.Tensor) -> list[torch.Tensor]:
    """The row indices of each group, in row order, groups in order of first appearance."""
    order: dict[int, list[int]] = {}
    for row, group in enumerate(group_ids.tolist()):
        order.setdefault(group, []).append(row)
    return [torch.tensor(rows) for rows in order.values()]


def _on_responses(per_response: torch.Tensor, inputs: AdvantageInputs) -> torch.Tensor:
    return per_response.unsqueeze(1) * inputs.response_mask.float()
