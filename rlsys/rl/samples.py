"""What the model said at a step, as rows a user reads beside the curves (`tracking.log_samples_every`):
each response with its prompt, its reward and every reward term, its advantage and its length. A reward
hack shows here first: the term that pays, on text that does not answer."""

from __future__ import annotations

import torch

from rlsys.agents.trajectory import Trajectory
from rlsys.algorithms.advantages import episode_ends
from rlsys.config.schema import RLJobConfig
from rlsys.rewards.scoring import ScoredSample


def samples_due(cfg: RLJobConfig, step: int) -> bool:
    """Whether step `step` writes its samples: every `log_samples_every` steps, or (-1) at each validation."""
    every = cfg.tracking.log_samples_every
    if every == -1:
        return step == cfg.train.steps or bool(cfg.train.val_every and step % cfg.train.val_every == 0)
    return every > 0 and step % every == 0


def sample_records(episodes: list[Trajectory], groups: torch.Tensor, scored: list[ScoredSample],
                   rewards: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor,
                   episode_of: torch.Tensor, tokenizer, limit: int) -> list[dict]:
    """The first `limit` episodes of the step as rows: the prompt, the response as the model saw it (special
    tokens and tool turns included: a multi-turn episode shows its turns; an episode whose history was
    rewritten, its earlier segments' responses too), the text the reward scored, the
    reward (shaped) and its score and terms, the episode's advantage (the mean over its last segment's
    response tokens), its sampled tokens, turns, tool calls and why it ended."""
    last_row = {episode_of[row].item(): row for row in torch.nonzero(episode_ends(episode_of)).flatten()}
    records = []
    for index, (episode, group, score) in enumerate(zip(episodes[:limit], groups.tolist(), scored)):
        row = last_row[index]
        tokens = loss_mask[row].sum().clamp(min=1)
        records.append({
            "group": group,
            "prompt": tokenizer.decode(episode.prompt_ids),
            "response": tokenizer.decode(episode.response_ids),
            "scored_text": episode.text,
            "reward": rewards[index].item(),
            "score": score.score,
            "terms": dict(score.terms),
            "advantage": ((advantages[row] * loss_mask[row]).sum() / tokens).item(),
            "length": sum(segment.sampled_tokens for segment in [*episode.earlier, episode]),
            "turns": episode.num_turns,
            "tool_calls": episode.tool_calls,
            "earlier_segments": [tokenizer.decode(segment.response_ids) for segment in episode.earlier],
            "finish_reason": episode.finish_reason,
        })
    return records
