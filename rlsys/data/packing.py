"""Several sequences per row: no forward or backward pass over padding.

A micro-batch's rows are right-padded to its longest row; RL responses vary in
length, so on the random 22.7 M-parameter benchmark model (up to 128 new tokens)
about half of a padded micro-batch is padding. Packing lays the rows end to end
into as few rows of that same width as first-fit-decreasing finds, each token
keeping its position in its own sequence (`position_ids`) and the index of its
sequence (`segment_ids`, from 1; 0 is padding), from which the engine builds a
block-causal attention mask: a token attends only to its own sequence.

Every [B, T] field is packed the same way, so a loss whose terms are sums over
tokens gives the same result on the packed micro-batch. The label of a sequence
packed after another is never a target: its `loss_mask` is 0 there, as position 0
of an unpacked row never is one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Batch = dict[str, torch.Tensor]


@dataclass
class Packing:
    batch: Batch
    """The packed fields, [rows, width], with position_ids and segment_ids."""
    source: tuple[torch.Tensor, torch.Tensor]
    """(row, column) in the unpacked micro-batch of every real token."""
    target: tuple[torch.Tensor, torch.Tensor]
    """(row, column) of the same tokens in the packed one."""
    shape: tuple[int, int]
    """The unpacked micro-batch's [B, T]."""

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """A per-token output [rows, width] back to [B, T]; column 0 (no prediction) is 0."""
        rows = torch.zeros(self.shape, dtype=packed.dtype, device=packed.device)
        rows[self.source] = packed[self.target]
        rows[:, 0] = 0
        return rows


def pack_rows(batch: Batch) -> Packing:
    """Pack the right-padded rows of `batch` (each of attention_mask.sum() tokens) into rows as
    wide as the batch."""
    mask = batch["attention_mask"].bool()
    lengths = mask.sum(1).tolist()
    width = mask.shape[1]
    placement = _first_fit_decreasing(lengths, width)
    num_rows = 1 + max(row for row, _ in placement)

    source_row, source_col = mask.nonzero(as_tuple=True)
    row_of = torch.tensor([row for row, _ in placement])
    offset_of = torch.tensor([offset for _, offset in placement])
    target_row, target_col = row_of[source_row], offset_of[source_row] + source_col

    packed = {}
    for name, values in batch.items():
        out = torch.zeros((num_rows, width), dtype=values.dtype)
        out[target_row, target_col] = values[source_row, source_col]
        packed[name] = out
    if "loss_mask" in packed:
        packed["loss_mask"][row_of, offset_of] = 0
    packed["position_ids"] = torch.zeros((num_rows, width), dtype=torch.long)
    packed["position_ids"][target_row, target_col] = source_col
    packed["segment_ids"] = torch.zeros((num_rows, width), dtype=torch.long)
    packed["segment_ids"][target_row, target_col] = source_row + 1
    return Packing(packed, (source_row, source_col), (target_row, target_col), tuple(mask.shape))


def _first_fit_decreasing(lengths: list[int], width: int) -> list[tuple[int, int]]:
    """(packed row, offset) of each sequence: longest first, each into the first row with room."""
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


def block_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] boolean: causal within each packed sequence, nothing across them; every
    position sees itself, so padding rows stay finite."""
    length = segment_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segment_ids.device).tril()
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    mask = causal & same & (segment_ids > 0)[:, None, :]
    return (mask | torch.eye(length, dtype=torch.bool, device=segment_ids.device))[:, None]
