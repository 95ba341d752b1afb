"""What one rank computes of a batch's sequences.

Context parallelism gives each rank a contiguous chunk of every sequence;
sequence parallelism splits what a rank's model sees once more, evenly between
the tensor-parallel ranks, so that length is padded to a multiple of tp. The
loss functions stay the same pure functions in every layout: under context
parallelism a rank's loss fields carry one token more than its chunk (the next
chunk's first token, or padding), so every next-token label is seen, the one
across the chunk boundary included, and the logits get one unused row to match.
Padding never counts: batches are right-padded with all masks 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from rlsys.data.batching import Batch
from rlsys.data.packing import Packing


@dataclass
class RankSequence:
    fields: Batch
    """The loss function's view of the batch, [B, span], or [B, span + 1] under context parallel."""
    input_ids: torch.Tensor
    """The model's input, [B, span]."""
    positions: torch.Tensor
    """Positions of the input tokens in their sequences, [1, span]."""
    length: int
    """The batch's own sequence length."""
    chunked: bool
    """Context parallel: the fields carry the next chunk's first token."""
    whole: Batch
    """The fields over every rank's input columns, [B, cp x span] (the fields without context
    parallel): what attention across the ranks' chunks is built from."""


def rank_sequence(batch: Batch, cp: int, cp_rank: int, multiple: int) -> RankSequence:
    """This rank's share of `batch`, the model's input padded to a multiple of `multiple`."""
    length = batch["input_ids"].shape[1]
    if cp == 1:
        fields = _pad_columns(batch, -length % multiple)
        span = fields["input_ids"].shape[1]
        return RankSequence(fields, fields["input_ids"], torch.arange(span).unsqueeze(0), length, chunked=False,
                            whole=fields)
    chunk = -(-length // (cp * multiple)) * multiple
    padded = _pad_columns(batch, chunk * cp + 1 - length)
    start = cp_rank * chunk
    fields = {name: value[:, start:start + chunk + 1] for name, value in padded.items()}
    return RankSequence(fields, fields["input_ids"][:, :chunk], torch.arange(start, start + chunk).unsqueeze(0),
                        length, chunked=True, whole={name: value[:, :chunk * cp] for name, value in padded.items()})


def loss_logits(logits: torch.Tensor, seq: RankSequence) -> torch.Tensor:
    """The logits as long as the loss fields: one unused row more under context parallel
    (padded on the local shard when loss parallel leaves them vocabulary-sharded)."""
    if not seq.chunked:
        return logits
    if isinstance(logits, DTensor):  # the global shape given: the vocabulary may split unevenly
        local = F.pad(logits.to_local(), (0, 0, 0, 1))
        rows, length, vocab = logits.shape
        return DTensor.from_local(local, logits.device_mesh, logits.placements, run_check=False,
                                  shape=(rows, length + 1, vocab), stride=((length + 1) * vocab, vocab, 1))
    return F.pad(logits, (0, 0, 0, 1))


def unpacked_logits(logits: torch.Tensor, packing: Packing) -> torch.Tensor:
    """A packed micro-batch's logits laid back out as its rows, [B, T, vocab], each row's as its
    own forward gives them (0 on padding), for a loss that reads each row as one sequence; the
    gradient flows back to the packed logits. Vocabulary-sharded logits (loss parallel) stay sharded."""
    if isinstance(logits, DTensor):
        local = packing.unpack(logits.to_local(), per_label=False)
        rows, length = packing.shape
        vocab = logits.shape[-1]
        return DTensor.from_local(local, logits.device_mesh, logits.placements, run_check=False,
                                  shape=(rows, length, vocab), stride=(length * vocab, vocab, 1))
    return packing.unpack(logits, per_label=False)


def whole_rows(rows: torch.Tensor, seq: RankSequence, cp_group) -> torch.Tensor:
    """Per-token outputs of `seq`'s fields -> [B, length, ...] in sequence order. Under context
    parallel (a collective over `cp_group`) column j + 1 of each rank's rows is its token
    j + 1 and column 0 is unused; the whole sequence's column 0 is zero."""
    if not seq.chunked:
        return rows[:, :seq.length]
    whole = _chunks_in_rank_order(rows[:, 1:], cp_group)
    return F.pad(whole, (0, 0) * (whole.dim() - 2) + (1, 0))[:, :seq.length]


def whole_positions(values: torch.Tensor, seq: RankSequence, cp_group) -> torch.Tensor:
    """Per-input-position values of `seq`, [B, span, ...] -> [B, length, ...] in sequence order
    (under context parallel, a collective over `cp_group`, each rank's chunk in rank order)."""
    if seq.chunked:
        values = _chunks_in_rank_order(values, cp_group)
    return values[:, :seq.length]


def _chunks_in_rank_order(chunk: torch.Tensor, cp_group) -> torch.Tensor:
    """Every context-parallel rank's `chunk`, laid end to end along dim 1."""
    parts = [torch.empty_like(chunk) for _ in range(dist.get_world_size(cp_group))]
    dist.all_gather(parts, chunk.contiguous(), group=cp_group)
    return torch.cat(parts, dim=1)


def pad_columns(value: torch.Tensor, extra: int) -> torch.Tensor:
    """`value` [B, T, ...] with `extra` zero columns after its T (per-token fields may carry
    trailing dimensions: a routing's layers and experts)."""
    return F.pad(value, (0, 0) * (value.dim() - 2) + (0, extra))


def _pad_columns(batch: Batch, extra: int) -> Batch:
    return {name: pad_columns(value, extra) for name, value in batch.items()} if extra else batch
