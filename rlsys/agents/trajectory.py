"""What an agent loop makes of one prompt, and how a rollout engine's trajectories travel.

A trajectory is token ids in, token ids out: the prompt's tokens, then every token after
it (the model's sampled turns and the tool or environment turns between them, each
tokenized once), a mask that is 1 on sampled tokens and 0 on the rest, and the engine's
log-prob of every sampled token. The trainer consumes trajectories only: its losses,
entropy, KL and advantages read the mask, whatever loop made the trajectory.

An episode (what one request produced) may hold several segments: a loop whose agent
rewrote its history (a summary, dropped tool outputs) starts a new one, with its own prompt.
The loop returns the last segment, the one the reward scores, with the earlier ones in
`earlier`; the trainer makes each segment a row of its batch, tagged with its episode.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class RolloutRequest:
    """One trajectory to make: sample `sample` of prompt `prompt_index`."""

    prompt_index: int
    prompt_ids: list[int]
    sample: int
    seed: int
    """The first model turn's sampling seed (later turns derive theirs from it)."""
    row: dict = field(default_factory=dict)
    """The data row as a loop sees it (`Prompt.row`): prompt, data_source, extra_info, images."""

    @property
    def images(self) -> list | None:
        """The prompt's pictures (a vision-language model's), which every model turn is given."""
        return self.row.get("images")

    @property
    def tools_kwargs(self) -> dict:
        """The row's `extra_info.tools_kwargs`: per tool name, `create_kwargs` for its instance."""
        extra_info = self.row.get("extra_info")
        kwargs = extra_info.get("tools_kwargs") if isinstance(extra_info, dict) else None
        return kwargs if isinstance(kwargs, dict) else {}


@dataclass(frozen=True)
class Sampling:
    """How every model turn of a rollout samples."""

    temperature: float
    top_p: float
    max_new_tokens: int
    """Per model turn."""
    max_response_tokens: int
    """For the whole response: sampled turns and the turns between them."""
    stop: tuple[str, ...] = ()


@dataclass
class Trajectory:
    prompt_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    """Every token after the prompt: sampled turns and the tool turns between them."""
    response_mask: list[int]
    """1 on a sampled token, 0 on a tool or environment token."""
    logprobs: list[float]
    """The engine's log-prob of each sampled token, in order (one per 1 in the mask)."""
    versions: list[int]
    """The weight version that sampled each sampled token (asynchronous RL: it may change mid-response)."""
    text: str | None
    """What the reward scores: the response decoded (special tokens skipped), filled in by the engine
    when a loop leaves it None; an agent harness gives its own answer (the `openai` loop)."""
    finish_reason: str
    """The last model turn's: "stop", "length", or the loop's own reason to end."""
    num_turns: int = 1
    """Model turns."""
    tool_calls: int = 0
    tool_errors: int = 0
    """Calls that became an error observation: malformed, unknown tool, raised, timed out."""
    tool_seconds: float = 0.0
    reward_info: dict[str, Any] = field(default_factory=dict)
    """What the loop hands the reward beside the data row's extra_info (turns, tool rewards)."""
    prefix_breaks: int = 0
    """Calls that did not continue the conversation recorded so far (the `openai` loop)."""
    dropped: str = ""
    """Why the loop made no trajectory to train on ("" when it did): the step leaves the sample out."""
    routing: np.ndarray | None = None
    """[tokens, hidden layers, k]: the experts the engine routed the trajectory's first tokens (prompt, then
    response) to in its last model turn, which computed every token before it (R3); None when not returned."""
    earlier: list[Trajectory] = field(default_factory=list)
    """The episode's earlier segments, oldest first, each with its own prompt (the history it ended with
    was rewritten before the next model turn); empty for an episode of one segment."""

    @property
    def sampled_tokens(self) -> int:
        return sum(self.response_mask)

    def segments(self, which: str = "all") -> list[Trajectory]:
        """The episode's segments to train on, oldest first: all of them (those with a sampled token),
        or the last alone."""
        if which == "last":
            return [self]
        return [*(segment for segment in self.earlier if segment.sampled_tokens), self]


def dropped(request: RolloutRequest, reason: str, prefix_breaks: int = 0) -> Trajectory:
    """The sample of `request` left out of the step, for `reason` (counted as `agent/dropped_<reason>`)."""
    return Trajectory(request.prompt_index, request.prompt_ids, [], [], [], [], text="", finish_reason=reason,
                      num_turns=0, prefix_breaks=prefix_breaks, dropped=reason)


def episode_rows(episodes: list[Trajectory], which: str = "all") -> tuple[list[Trajectory], list[int]]:
    """The segments of `episodes` to train on (`Trajectory.segments`), each a row, episode after episode,
    and the index of each row's episode."""
    rows, episode_of = [], []
    for index, episode in enumerate(episodes):
        segments = episode.segments(which)
        rows += segments
        episode_of += [index] * len(segments)
    return rows, episode_of


@dataclass
class Trajectories:
    """One engine's trajectories as columns, in request order: Ray sends a few arrays far faster
    than as many small objects."""

    prompt_index: np.ndarray
    lengths: np.ndarray
    response_ids: np.ndarray
    """Every trajectory's response tokens, back to back."""
    response_mask: np.ndarray
    logprobs: np.ndarray
    """Every sampled token's log-prob, back to back."""
    versions: np.ndarray
    """Every sampled token's weight version, back to back."""
    texts: list[str]
    finish_reasons: list[str]
    num_turns: np.ndarray
    tool_calls: np.ndarray
    tool_errors: np.ndarray
    tool_seconds: np.ndarray
    reward_info: list[dict]
    prefix_breaks: np.ndarray
    dropped: list[str]
    routing: np.ndarray | None = None
    """Every trajectory's `routing`, back to back (None when none has one)."""
    routing_lengths: np.ndarray | None = None
    own_prompts: dict[int, list[int]] = field(default_factory=dict)
    """The prompt ids of each trajectory (by position) whose prompt is not its request's: an agent
    harness writes its own (the `openai` loop)."""
    earlier: dict[int, list[Trajectory]] = field(default_factory=dict)
    """The earlier segments of each trajectory (by position) that has any."""
    stats: dict[str, float] = field(default_factory=dict)
    """The engine's own figures of the rollout: its wall time (rollout_s) and the time in engine steps (engine_s)."""

    @classmethod
    def of(cls, trajectories: list[Trajectory], requests: list[RolloutRequest],
           stats: dict[str, float] | None = None) -> Trajectories:
        """The columns of `trajectories`, made for `requests` (in the same order)."""
        column = lambda name, dtype: np.array([getattr(t, name) for t in trajectories], dtype=dtype)  # noqa: E731
        chain = lambda name, dtype: np.fromiter(  # noqa: E731
            itertools.chain.from_iterable(getattr(t, name) for t in trajectories), dtype=dtype)
        own_prompts = {i: t.prompt_ids for i, (t, request) in enumerate(zip(trajectories, requests))
                       if t.prompt_ids != request.prompt_ids}
        return cls(column("prompt_index", np.int64), np.array([len(t.response_ids) for t in trajectories], np.int64),
                   chain("response_ids", np.int64), chain("response_mask", np.int8), chain("logprobs", np.float32),
                   chain("versions", np.int32), [t.text for t in trajectories], [t.finish_reason for t in trajectories],
                   column("num_turns", np.int32), column("tool_calls", np.int32), column("tool_errors", np.int32),
                   column("tool_seconds", np.float64), [t.reward_info for t in trajectories],
                   column("prefix_breaks", np.int32), [t.dropped for t in trajectories], *_routing(trajectories),
                   own_prompts, {i: t.earlier for i, t in enumerate(trajectories) if t.earlier}, stats or {})

    def unpack(self, prompt_ids: dict[int, list[int]]) -> list[Trajectory]:
        """One `Trajectory` per request; `prompt_ids`: the ids of each prompt index."""
        ends = np.cumsum(self.lengths).tolist()
        starts = [0, *ends[:-1]]
        masks = self.response_mask.tolist()
        sampled_ends = np.cumsum([sum(masks[s:e]) for s, e in zip(starts, ends)]).tolist()
        sampled_starts = [0, *sampled_ends[:-1]]
        ids, logprobs, versions = self.response_ids.tolist(), self.logprobs.tolist(), self.versions.tolist()
        routings = self._routings()
        return [Trajectory(index, self.own_prompts.get(i, prompt_ids[index]), ids[start:end], masks[start:end],
                           logprobs[ls:le], versions[ls:le], text, finish, int(turns), int(calls), int(errors),
                           float(seconds), info, int(breaks), dropped, routings[i], self.earlier.get(i, []))
                for i, (index, start, end, ls, le, text, finish, turns, calls, errors, seconds, info, breaks, dropped)
                in enumerate(zip(self.prompt_index.tolist(), starts, ends, sampled_starts, sampled_ends, self.texts,
                                 self.finish_reasons, self.num_turns, self.tool_calls, self.tool_errors,
                                 self.tool_seconds, self.reward_info, self.prefix_breaks, self.dropped))]

    def _routings(self) -> list[np.ndarray | None]:
        if self.routing is None:
            return [None] * len(self.lengths)
        ends = np.cumsum(self.routing_lengths).tolist()
        return [self.routing[start:end] if end > start else None for start, end in zip([0, *ends[:-1]], ends)]


def _routing(trajectories: list[Trajectory]) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The trajectories' routings back to back and their lengths (0: none), or (None, None)."""
    routings = [t.routing for t in trajectories if t.routing is not None]
    if not routings:
        return None, None
    lengths = np.array([0 if t.routing is None else len(t.routing) for t in trajectories], np.int64)
    return np.concatenate(routings), lengths
