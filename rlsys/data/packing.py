"""Several sequences per row: no forward or backward pass over padding, and one pass over a
prompt its samples share.

A micro-batch's rows are right-padded to its longest row; RL responses vary in
length, so much of a padded micro-batch can be padding (docs/performance.md
measures how much). Packing lays the rows end to end
into as few rows as first-fit-decreasing finds, each token keeping its position in
its own sequence (`position_ids`) and the index of its span (`segment_ids`, from 1;
0 is padding): a token attends only to its own span.

A GRPO group's samples repeat one prompt, so rows whose prompts (the tokens before
their first loss token) are the same token for token may share one copy of it
(Prefix Grouper, arXiv 2506.05433): the prompt's first P - 1 tokens once, then each
sample's last prompt token and response, whose tokens also attend to the shared span
(`prefix_ids`). Every token sees what it saw in its own row, so activations are the
same and the shared span's gradient is the sum of the copies' gradients; repeating the
last prompt token keeps each response's first label next to the logits that predict
it. Every group whose samples repeat a prompt of two tokens or more shares it, unless the
micro-batch would then lay out more cells (rows x width, padding included) than unshared:
a shared group is one unit as wide as all its samples, and every row is as wide as the
widest unit. The training ranks attend a packed batch span by span
(`rlsys.parallel.span_attention`): each span scores its own pairs and its shared prompt's,
never the row's whole width.

Every [B, T, ...] field is packed the same way, so a loss whose terms are sums over
tokens gives the same result on the packed micro-batch. The label of a span packed
after another is never a target: its `loss_mask` is 0 there, as position 0 of an
unpacked row never is one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from rlsys.data.batching import Batch


@dataclass
class Packing:
    batch: Batch
    """The packed fields, [rows, width], with position_ids, segment_ids and prefix_ids."""
    source: tuple[torch.Tensor, torch.Tensor]
    """(row, column) in the unpacked micro-batch of every packed token."""
    target: tuple[torch.Tensor, torch.Tensor]
    """(row, column) of the same tokens in the packed one."""
    shape: tuple[int, int]
    """The unpacked micro-batch's [B, T]."""
    prompt_row: torch.Tensor
    """[B]: the row whose packed prompt each row reads back (itself unless it shares one)."""
    shared_length: torch.Tensor
    """[B]: how many leading tokens each row reads from `prompt_row` (0 unless it shares)."""

    def unpack(self, packed: torch.Tensor, per_label: bool = True) -> torch.Tensor:
        """A per-token output [rows, width, ...] back to [B, T, ...]. A shared prompt's tokens read
        the copy whose output saw the whole prompt. `per_label`: an output for each token's label
        (a log-prob), whose column 0 (nothing predicts the first token) is 0; else an output for
        each input token (the experts it went to)."""
        rows = torch.zeros((*self.shape, *packed.shape[2:]), dtype=packed.dtype, device=packed.device)
        rows[self.source] = packed[self.target]
        shared = torch.arange(self.shape[1], device=packed.device) < self.shared_length[:, None].to(packed.device)
        shared = shared.view(*shared.shape, *[1] * (packed.dim() - 2))
        rows = torch.where(shared, rows[self.prompt_row.to(packed.device)], rows)
        if per_label:
            rows[:, 0] = 0
        return rows


@dataclass(frozen=True)
class _Span:
    """Columns [start, end) of one row, laid out contiguously."""
    row: int
    start: int
    end: int
    continues_prompt: bool = False
    """Also attends to its unit's first span: the prompt it shares."""


def pack_rows(batch: Batch, share_prompts: bool = True) -> Packing:
    """Pack the right-padded rows of `batch` (each of attention_mask.sum() tokens) into rows as
    wide as the batch, or as its widest shared group (`share_prompts`: rows with the same prompt
    lay it out once, unless that lays out more cells, padding included: a group as wide as all its
    samples widens every row)."""
    lengths = batch["attention_mask"].sum(1).tolist()
    layout = _layout(batch, lengths, share_prompts)
    if any(layout.shared_length):  # sharing widens the rows to its widest group: keep it if it saves cells
        layout = min(layout, _layout(batch, lengths, False), key=lambda candidate: candidate.cells)
    units, prompt_row, shared_length, placement, width = layout
    num_rows = layout.rows

    spans = _span_table(units, placement)
    sizes = spans[_SPAN_FIELDS.index("size")]
    per_token = dict(zip(_SPAN_FIELDS, spans.repeat_interleave(sizes, dim=1)))
    within = torch.arange(len(per_token["size"])) - (sizes.cumsum(0) - sizes).repeat_interleave(sizes)
    source = (per_token["row"], per_token["start"] + within)
    target = (per_token["packed_row"], per_token["offset"] + within)

    packed = {}
    for name, values in batch.items():
        out = torch.zeros((num_rows, width, *values.shape[2:]), dtype=values.dtype)
        out[target] = values[source]
        packed[name] = out
    if "loss_mask" in packed:
        starts = within == 0
        packed["loss_mask"][target[0][starts], target[1][starts]] = 0
    for name, values in (("position_ids", source[1]), ("segment_ids", per_token["segment"]),
                         ("prefix_ids", per_token["prefix"])):
        packed[name] = torch.zeros((num_rows, width), dtype=torch.long)
        packed[name][target] = values
    return Packing(packed, source, target, tuple(batch["attention_mask"].shape),
                   torch.tensor(prompt_row), torch.tensor(shared_length))


class _Layout(NamedTuple):
    units: list[list[_Span]]
    """The spans packed together (`_units`)."""
    prompt_row: list[int]
    shared_length: list[int]
    placement: list[tuple[int, int]]
    """Each unit's (packed row, offset)."""
    width: int

    @property
    def rows(self) -> int:
        return 1 + max(row for row, _ in self.placement)

    @property
    def cells(self) -> int:
        """Rows x width: the positions a forward computes, padding included."""
        return self.rows * self.width


def _layout(batch: Batch, lengths: list[int], share_prompts: bool) -> _Layout:
    units, prompt_row, shared_length = _units(batch, lengths, share_prompts)
    unit_lengths = [sum(span.end - span.start for span in unit) for unit in units]
    width = max(batch["attention_mask"].shape[1], *unit_lengths)
    return _Layout(units, prompt_row, shared_length, _first_fit_decreasing(unit_lengths, width), width)


_SPAN_FIELDS = ("row", "start", "size", "packed_row", "offset", "segment", "prefix")


def _span_table(units: list[list[_Span]], placement: list[tuple[int, int]]) -> torch.Tensor:
    """[len(_SPAN_FIELDS), spans], in packing order: each span's source row and start, size,
    packed row and offset, segment id (from 1) and the segment id of the prompt it continues
    (0 if none)."""
    entries = []
    for unit, (packed_row, offset) in zip(units, placement):
        prompt_segment = len(entries) + 1
        for span in unit:
            size = span.end - span.start
            entries.append((span.row, span.start, size, packed_row, offset, len(entries) + 1,
                            prompt_segment if span.continues_prompt else 0))
            offset += size
    return torch.tensor(entries, dtype=torch.long).T


def _units(batch: Batch, lengths: list[int], share_prompts: bool):
    """The spans packed together, each unit into one row: a row on its own, or a group's
    shared prompt followed by its samples. Also each row's `prompt_row` and `shared_length`."""
    rows = len(lengths)
    prompt_row, shared_length = list(range(rows)), [0] * rows
    units, alone = [], set(range(rows))
    for members, prompt in _prompt_groups(batch) if share_prompts else []:
        first = members[0]
        units.append([_Span(first, 0, prompt - 1)] + [_Span(r, prompt - 1, lengths[r], True) for r in members])
        for r in members:
            prompt_row[r], shared_length[r] = first, prompt
        alone -= set(members)
    units += [[_Span(r, 0, lengths[r])] for r in sorted(alone)]
    return units, prompt_row, shared_length


def _prompt_groups(batch: Batch) -> list[tuple[list[int], int]]:
    """(rows, prompt length) of each set of two or more rows with the same prompt (the tokens
    before the first loss token, two or more of them)."""
    if "loss_mask" not in batch:
        return []
    has_target = batch["loss_mask"].bool()
    prompt_lengths = torch.where(has_target.any(1), has_target.int().argmax(1), 0).tolist()
    groups: dict[tuple[int, ...], list[int]] = {}
    for row, (ids, prompt) in enumerate(zip(batch["input_ids"].tolist(), prompt_lengths)):
        if prompt >= 2:
            groups.setdefault(tuple(ids[:prompt]), []).append(row)
    return [(members, len(prompt_ids)) for prompt_ids, members in groups.items() if len(members) > 1]


def _first_fit_decreasing(lengths: list[int], width: int) -> list[tuple[int, int]]:
    """(packed row, offset) of each unit: longest first, each into the first row with room."""
    free: list[int] = []
    placement: list[tuple[int, int]] = [(0, 0)] * len(lengths)
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        length = lengths[index]
        row = next((r for r, room in enumerate(free) if room >= length), len(free))
        if row == len(free):
            free.append(width)
        placement[index] = (row, width - free[row])
        free[row] -= length
    return placement


def block_causal_mask(segment_ids: torch.Tensor, prefix_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[B, 1, T, T] boolean: causal within each packed span and from a span into the shared
    prompt it continues (`prefix_ids`), nothing else across spans; every position sees itself,
    so padding rows stay finite."""
    length = segment_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segment_ids.device).tril()
    visible = segment_ids[:, :, None] == segment_ids[:, None, :]
    if prefix_ids is not None:
        visible |= prefix_ids[:, :, None] == segment_ids[:, None, :]
    mask = causal & visible & (segment_ids > 0)[:, None, :]
    return (mask | torch.eye(length, dtype=torch.bool, device=segment_ids.device))[:, None]
