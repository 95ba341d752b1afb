"""Several sequences per row: no forward or backward pass over padding, and one pass over the
context rows share.

A micro-batch's rows are right-padded to its longest row; RL responses vary in
length, so much of a padded micro-batch can be padding (docs/performance.md
measures how much). Packing lays the rows end to end
into as few rows as first-fit-decreasing finds, each token keeping its position in
its own sequence (`position_ids`) and the index of its span (`segment_ids`, from 1;
0 is padding): a token attends only to its own span.

A GRPO group's samples repeat one prompt, a batch's prompts may open with one system prompt,
and the later segments of an episode whose history a harness rewrote repeat what came before
the rewritten part, an earlier segment's trained turns included: rows that begin alike share
one copy of what they repeat, as a tree (Prefix Grouper, arXiv 2506.05433, for one prompt;
AReaL's tree training for an agent's turns). Each node of the tree is a span of the tokens its
rows have in common past its parent's, and a row's own span holds the rest of it; every span's
tokens also attend to its ancestors' (`prefix_ids`: the span it continues). A node ends one
token before its rows part, and each child repeats that token; the child laid out right after
it (its first continuation) reads that token's label from the node's last logits, the others
read it from there. Every token sees what it saw in its own row, so activations are the same
and a shared token's gradient is the sum of its copies'.

A token a loss trains is shared only with rows that hold it as context: every label a node
computes (its own tokens' but the first, and its first continuation's first) is trained by at
most one of its rows, its owner, whose per-token fields (loss mask, advantage, old log-prob)
the node's copy carries. Two rows that both train a token (two samples that begin their answers
alike) part before it, each with its own copy and fields. Every node of two tokens or more at
the root, one or more below, is laid out once, unless the micro-batch would then lay out more
cells (rows x width, padding included) than unshared: a tree is one unit as wide as all its
rows, and every row is as wide as the widest unit. The training ranks attend a packed batch span
by span (`rlsys.parallel.span_attention`): each span scores its own pairs and its ancestors',
never the row's whole width.

Every [B, T, ...] field is packed the same way, so a loss whose terms are sums over
tokens gives the same result on the packed micro-batch. The first label of a span packed
after another is never a target (its `loss_mask` is 0 there, as position 0 of an unpacked
row never is one), but where the span is its parent's first continuation: that label is
predicted by the parent's last token, and its fields are the parent's owner's.
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
    shape: tuple[int, int]
    """The unpacked micro-batch's [B, T]."""
    reads: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    """(row, column) of every token of the unpacked micro-batch, then (row, column) of the packed copy its
    outputs are read from: its own, but the first child's for a token its tree's children all repeat
    (the copy laid out right after the node, whose per-label output saw the node's last token)."""

    def unpack(self, packed: torch.Tensor, per_label: bool = True) -> torch.Tensor:
        """A per-token output [rows, width, ...] back to [B, T, ...], each token's from the copy that
        `reads` names. `per_label`: an output for each token's label (a log-prob), whose column 0
        (nothing predicts the first token) is 0; else an output for each input token (the experts it
        went to)."""
        rows = torch.zeros((*self.shape, *packed.shape[2:]), dtype=packed.dtype, device=packed.device)
        row, column, packed_row, packed_column = (index.to(packed.device) for index in self.reads)
        rows[row, column] = packed[packed_row, packed_column]
        if per_label:
            rows[:, 0] = 0
        return rows


class _Span(NamedTuple):
    """Columns [start, end) of one row, laid out contiguously."""
    row: int
    start: int
    end: int
    parent: int = -1
    """The index in its unit of the span it continues, whose keys (and its ancestors') it also
    attends to; -1 for none."""
    rows: tuple[int, ...] = ()
    """The rows whose tokens it holds: a node's rows, or a row's own span's one row."""


def pack_rows(batch: Batch, share_prompts: bool = True, keys: torch.Tensor | None = None) -> Packing:
    """Pack the right-padded rows of `batch` (each of attention_mask.sum() tokens) into rows as
    wide as the batch, or as its widest tree (`share_prompts`: rows that begin alike lay
    out what they repeat once, unless that lays out more cells, padding included: a tree as wide
    as all its rows widens every row).

    `keys` [B, T]: what rows are compared by where not their input ids. A negative key marks a
    token of an input the model reads whole, once (a picture's): no child of a tree repeats one
    (a tree whose node would end on one is not used; its rows are laid out alone)."""
    lengths = batch["attention_mask"].sum(1).tolist()
    layout = _layout(batch, lengths, _Rows.of(batch, lengths, keys) if share_prompts else None)
    if layout.shares:  # sharing widens the rows to its widest tree: keep it if it saves cells
        layout = min(layout, _layout(batch, lengths, None), key=lambda candidate: candidate.cells)
    spans = _span_table(layout.units, layout.placement)
    sizes = spans[_SPAN_FIELDS.index("size")]
    per_token = dict(zip(_SPAN_FIELDS, spans.repeat_interleave(sizes, dim=1)))
    within = index_within_runs(sizes)
    first = within == 0  # a first continuation's first token carries its parent's owner's fields
    source = (torch.where(first, per_token["head_row"], per_token["row"]), per_token["start"] + within)
    target = (per_token["packed_row"], per_token["offset"] + within)

    packed = {}
    for name, values in batch.items():
        out = torch.zeros((layout.rows, layout.width, *values.shape[2:]), dtype=values.dtype)
        out[target] = values[source]
        packed[name] = out
    if "loss_mask" in packed:  # a span's first label is predicted in another span, or by nothing
        starts = first & (per_token["continues"] == 0)
        packed["loss_mask"][target[0][starts], target[1][starts]] = 0
    for name, values in (("position_ids", source[1]), ("segment_ids", per_token["segment"]),
                         ("prefix_ids", per_token["prefix"])):
        packed[name] = torch.zeros((layout.rows, layout.width), dtype=torch.long)
        packed[name][target] = values
    return Packing(packed, tuple(batch["attention_mask"].shape), _reads(layout, spans[_SPAN_FIELDS.index("offset")]))


def index_within_runs(sizes: torch.Tensor) -> torch.Tensor:
    """Each element's index in its run, for runs of `sizes` elements laid end to end."""
    return torch.arange(int(sizes.sum()), device=sizes.device) - (sizes.cumsum(0) - sizes).repeat_interleave(sizes)


class _Layout(NamedTuple):
    units: list[list[_Span]]
    """The spans packed together: a row alone, or a tree of rows (`_tree_unit`), each unit's spans in the
    order they are laid out."""
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

    @property
    def shares(self) -> bool:
        return any(len(unit) > 1 for unit in self.units)


def _layout(batch: Batch, lengths: list[int], rows: _Rows | None) -> _Layout:
    """The units of `rows` shared as trees (None: each row alone), first-fit into rows."""
    trees = [tree for tree in _trees(rows) if not _repeats_whole_input(tree, rows)] if rows is not None else []
    units = [_tree_unit(tree, lengths) for tree in trees]
    shared = {row for tree in trees for row in tree.rows}
    units += [[_Span(row, 0, lengths[row], rows=(row,))] for row in range(len(lengths)) if row not in shared]
    unit_lengths = [sum(span.end - span.start for span in unit) for unit in units]
    width = max(batch["attention_mask"].shape[1], *unit_lengths)
    return _Layout(units, _first_fit_decreasing(unit_lengths, width), width)


class _Rows(NamedTuple):
    """What the tree is grown over: each row's tokens, and which of its labels a loss trains."""
    ids: list[list[int]]
    trains: list[list[bool]]
    """trains[row][t]: the loss trains token t of the row (predicted from token t - 1)."""

    @classmethod
    def of(cls, batch: Batch, lengths: list[int], keys: torch.Tensor | None = None) -> _Rows:
        """The rows of `batch`, compared by `keys` (else their input ids); none to share where it has no
        loss mask, which a loss over every token may stand for (a shared token would count once for
        all its rows)."""
        if "loss_mask" not in batch:
            return cls([[] for _ in lengths], [[] for _ in lengths])
        ids = [row[:length] for row, length in zip((batch["input_ids"] if keys is None else keys).tolist(), lengths)]
        trains = [row[:length] for row, length in zip(batch["loss_mask"].bool().tolist(), lengths)]
        return cls(ids, trains)


@dataclass
class _Node:
    """Rows that agree on their first `depth` tokens, the first of them its owner (the one row, if
    any, that trains a label the node computes: its tokens' past its first, and token depth - 1),
    and the nodes of those of them that agree on more."""
    rows: list[int]
    depth: int
    children: list[_Node]


def _trees(rows: _Rows) -> list[_Node]:
    """The trees of rows that begin with the same two tokens or more."""
    return [_grow(part, rows, 2) for part in _parted(range(len(rows.ids)), rows, 2)]


def _parted(candidates, rows: _Rows, depth: int) -> list[list[int]]:
    """The sets of two or more `candidates` that are at least `depth` tokens long and agree on them
    (only token depth - 1 is compared: they agree on the ones before), each with at most one row
    that trains token depth - 1, first: where several do, each takes the rows that agree with it
    longest."""
    parts: dict[tuple[int, ...] | int, list[int]] = {}
    for row in candidates:
        if len(rows.ids[row]) >= depth:
            key = tuple(rows.ids[row][:depth]) if depth == 2 else rows.ids[row][depth - 1]
            parts.setdefault(key, []).append(row)
    split = [group for part in parts.values() for group in _by_owner(part, rows, depth - 1)]
    return [group for group in split if len(group) > 1]


def _by_owner(part: list[int], rows: _Rows, column: int) -> list[list[int]]:
    """`part` as groups of at most one row that trains token `column`, that row first."""
    owners = [row for row in part if rows.trains[row][column]]
    if not owners:
        return [part]
    groups = {owner: [owner] for owner in owners}
    for row in part:
        if row not in groups:
            groups[max(owners, key=lambda owner: _common_length(rows.ids[row], rows.ids[owner]))].append(row)
    return list(groups.values())


def _common_length(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _grow(part: list[int], rows: _Rows, depth: int) -> _Node:
    """The tree of the rows of `part` (agreeing on their first `depth` tokens, at least; its first
    row trains token depth - 1 if one does), grown from a stack of its unfinished nodes rather than
    by recursion: an episode's segments may nest hundreds deep."""
    root = _Node(part, depth, [])
    unfinished = [root]
    while unfinished:
        node = unfinished.pop()
        node.depth, owner = _agreement(node.rows, rows, node.depth)
        if owner is not None:
            node.rows.remove(owner)
            node.rows.insert(0, owner)
        node.children = [_Node(group, node.depth + 1, []) for group in _parted(node.rows, rows, node.depth + 1)]
        unfinished.extend(node.children)
    return root


def _agreement(members: list[int], rows: _Rows, depth: int) -> tuple[int, int | None]:
    """How many leading tokens `members` agree on, knowing they agree on `depth`, while at most one
    of them (the owner, returned) trains the tokens from depth - 1 on."""
    owner = next((row for row in members if rows.trains[row][depth - 1]), None)
    shortest = min(len(rows.ids[row]) for row in members)
    first = rows.ids[members[0]]
    while depth < shortest and all(rows.ids[row][depth] == first[depth] for row in members):
        trainers = {row for row in members if rows.trains[row][depth]} | ({owner} if owner is not None else set())
        if len(trainers) > 1:
            break
        owner = next(iter(trainers), None)
        depth += 1
    return depth, owner


def _tree_unit(tree: _Node, lengths: list[int]) -> list[_Span]:
    """A tree's spans, each node before its subtree: the node's columns past its parent's (its
    fields its owner's), its last shared token left to its children (each of which repeats it),
    then its children's subtrees in turn, then the rows that part from it."""
    unit: list[_Span] = []
    to_lay_out: list[tuple[_Node, int, int] | tuple[_Node, int]] = [(tree, 0, -1)]  # a node, or its rows' spans
    while to_lay_out:
        task = to_lay_out.pop()
        if len(task) == 2:
            node, index = task
            in_children = {row for child in node.children for row in child.rows}
            unit.extend(_Span(row, node.depth - 1, lengths[row], index, (row,)) for row in node.rows
                        if row not in in_children)
            continue
        node, start, parent = task
        unit.append(_Span(node.rows[0], start, node.depth - 1, parent, tuple(node.rows)))
        to_lay_out.append((node, len(unit) - 1))
        to_lay_out.extend((child, node.depth - 1, len(unit) - 1) for child in reversed(node.children))
    return unit


def _repeats_whole_input(tree: _Node, rows: _Rows) -> bool:
    """Whether a node of `tree` ends on a token of an input read whole (its key negative), which each
    span continuing the node would lay out again."""
    nodes = [tree]
    while nodes:
        node = nodes.pop()
        if rows.ids[node.rows[0]][node.depth - 1] < 0:
            return True
        nodes.extend(node.children)
    return False


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


_SPAN_FIELDS = ("row", "start", "size", "packed_row", "offset", "segment", "prefix", "continues", "head_row")


def _span_table(units: list[list[_Span]], placement: list[tuple[int, int]]) -> torch.Tensor:
    """[len(_SPAN_FIELDS), spans], in packing order: each span's source row and start, size,
    packed row and offset, segment id (from 1), the segment id of the span it continues (0 if
    none), whether it is laid out right after that span (its first continuation, whose first label
    the parent's last token predicts) and the row its first token's fields come from (the parent's
    owner there, else its own)."""
    entries = []
    for unit, (packed_row, offset) in zip(units, placement):
        first_segment = len(entries) + 1
        for index, span in enumerate(unit):
            size = span.end - span.start
            continues = _continues(span, index)
            entries.append((span.row, span.start, size, packed_row, offset, len(entries) + 1,
                            first_segment + span.parent if span.parent >= 0 else 0, int(continues),
                            unit[span.parent].row if continues else span.row))
            offset += size
    return torch.tensor(entries, dtype=torch.long).T


def _continues(span: _Span, index: int) -> bool:
    """Whether the span at `index` of its unit is its parent's first continuation, laid out right
    after it: its first label is predicted by the parent's last token."""
    return span.parent >= 0 and span.parent == index - 1


def _reads(layout: _Layout, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`Packing.reads`: each row's columns along its path from its tree's root to its own span, in
    runs; a span's first column, which every child of its parent repeats, read from the first child
    (laid out right after the parent). `offsets`: each span's packed column, in packing order."""
    runs = []  # (row, column, size, packed row, packed column)
    first_span = 0  # the unit's first span's index in packing order
    for unit, (packed_row, _) in zip(layout.units, layout.placement):
        unit_offsets = offsets[first_span:first_span + len(unit)].tolist()
        first_span += len(unit)
        for index, span in enumerate(unit):
            for row in span.rows:
                skip = 0
                if span.parent >= 0 and not _continues(span, index):  # the parent's first continuation follows it
                    runs.append((row, span.start, 1, packed_row, unit_offsets[span.parent + 1]))
                    skip = 1
                runs.append((row, span.start + skip, span.end - span.start - skip, packed_row,
                             unit_offsets[index] + skip))
    row, column, size, packed_row, packed_column = torch.tensor(runs, dtype=torch.long).T
    within = index_within_runs(size)
    return (row.repeat_interleave(size), column.repeat_interleave(size) + within, packed_row.repeat_interleave(size),
            packed_column.repeat_interleave(size) + within)


def span_ancestors(segment_ids: torch.Tensor, prefix_ids: torch.Tensor) -> list[list[int]]:
    """Each segment's ancestors (index 0: padding, none), root first: the spans whose keys it also
    attends to, read from the segment each one continues (`prefix_ids`)."""
    parents = torch.zeros(int(segment_ids.max()) + 1, dtype=torch.long)
    parents[segment_ids.flatten().cpu()] = prefix_ids.flatten().cpu()
    ancestors: list[list[int]] = [[]]
    for parent in parents.tolist()[1:]:  # a parent's segment id is below its children's
        ancestors.append(ancestors[parent] + [parent] if parent else [])
    return ancestors


def rows_per_span(segment_ids: torch.Tensor, prefix_ids: torch.Tensor) -> torch.Tensor:
    """[segments + 1]: how many unpacked rows each span's tokens stand for (a node: the rows below it;
    a row's own span: 1)."""
    ancestors = span_ancestors(segment_ids, prefix_ids)
    counts = torch.zeros(len(ancestors), dtype=torch.long)
    leaves = set(range(1, len(ancestors))) - {parent for chain in ancestors for parent in chain}
    for leaf in leaves:
        counts[[leaf, *ancestors[leaf]]] += 1
    return counts


def block_causal_mask(segment_ids: torch.Tensor, prefix_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[B, 1, T, T] boolean: causal within each packed span and from a span into the spans it
    continues (its ancestors, `prefix_ids`), nothing else across spans; every position sees itself,
    so padding rows stay finite."""
    length = segment_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segment_ids.device).tril()
    sees = torch.eye(int(segment_ids.max()) + 1, dtype=torch.bool)
    if prefix_ids is not None:
        for segment, ancestors in enumerate(span_ancestors(segment_ids, prefix_ids)):
            sees[segment, ancestors] = True
    visible = sees.to(segment_ids.device)[segment_ids[:, :, None], segment_ids[:, None, :]]
    mask = causal & visible & (segment_ids > 0)[:, None, :]
    return (mask | torch.eye(length, dtype=torch.bool, device=segment_ids.device))[:, None]
