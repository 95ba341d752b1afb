"""Attention over packed spans, each a sequence or a response continuing the prompt its group
shares (`rlsys.data.packing`), computed span by span instead of over a row's whole width.

Packing lays a GRPO group out as one span for its prompt followed by a span for each sample;
under a dense block-causal mask attention scores every pair of the row's columns, so a row as
wide as the group's samples together costs more attention than the unshared rows it
replaces. Here each span's queries attend to its shared prompt's keys and its own, nothing
else: the scores a span computes are the ones its tokens use, so sharing the prompt saves
attention as it saves the projections and the MLP. Spans are gathered into batches of like
spans (those continuing a prompt, those that do not) of like lengths (`LENGTH_BUCKET`), padded to
the longest of each, and run through PyTorch's scaled_dot_product_attention: causal without a
mask where a span continues nothing (its padding lies after its last query), with each span's
own [queries x keys] mask where it continues a prompt. The outputs are scattered back to the
packed positions. Every token sees exactly what it sees in its own unpacked row.

It takes SDPA's entry in transformers' attention interface (`apply_span_attention`, for a model
whose attention is SDPA over full causal layers) and is SDPA itself for every call without
`shared_spans`: only packed micro-batches whose spans save enough (`SharedPrefixSpans.of`) take
this path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

MIN_PAIRS_SAVED_PER_TOKEN = 128
"""Attend by spans only where that scores at least this many fewer query-key pairs than a dense
mask would, per token of the micro-batch: gathering each span's keys (its shared prompt's among
them) costs a roughly fixed amount per token, which short sequences do not win back (the figures:
docs/performance.md, "Shared prompts in the update")."""


LENGTH_BUCKET = 1.25
"""Spans batched together differ in length by at most this factor, so that padding a span to its
batch's longest costs at most (1.25^2 - 1) of its own attention."""


@dataclass
class _SpanBatch:
    """Like spans, padded to the longest: where their queries and keys sit in the flattened
    [rows x width] positions, and which key each query sees."""
    queries: torch.Tensor
    """[S, Lq] flat position of each span's i-th token (0 where the span is shorter)."""
    real: torch.Tensor
    """[S, Lq] bool: a real query."""
    keys: torch.Tensor
    """[S, Lk] flat position of each key: the shared prompt's, then the span's own."""
    mask: torch.Tensor | None
    """[S, 1, Lq, Lk] bool: what each query sees (a padded query sees something, to stay finite);
    None where no span continues a prompt: each query sees its own span causally."""
    targets: torch.Tensor
    """[real queries]: their flat positions, in `real`'s order."""


class SharedPrefixSpans:
    """The spans of a packed micro-batch, grouped into `_SpanBatch`es (`of`)."""

    def __init__(self, batches: list[_SpanBatch]):
        self.batches = batches

    def to(self, device: torch.device) -> SharedPrefixSpans:
        """The spans' index tensors on `device` (they are chosen on the host copy of the packing)."""
        return SharedPrefixSpans([_SpanBatch(**{name: None if value is None else value.to(device)
                                                for name, value in vars(spans).items()}) for spans in self.batches])

    @classmethod
    def of(cls, segment_ids: torch.Tensor, prefix_ids: torch.Tensor,
           min_pairs_saved: float = MIN_PAIRS_SAVED_PER_TOKEN) -> SharedPrefixSpans | None:
        """The spans of a packed micro-batch (`segment_ids` from 1 per span, 0 for padding;
        `prefix_ids` the segment a span continues, 0 for none), or None where their (padded)
        query-key pairs are not at least `min_pairs_saved` per token fewer than a dense mask's."""
        rows, width = segment_ids.shape
        segments, prefixes = segment_ids.flatten(), prefix_ids.flatten()
        real = segments > 0
        ids, positions = segments[real], torch.arange(rows * width, device=segments.device)[real]
        zeros = torch.zeros(int(ids.max()) + 1, dtype=torch.long, device=ids.device)
        lengths = zeros.index_add(0, ids, torch.ones_like(ids))
        starts = zeros.scatter_reduce(0, ids, positions, "amin", include_self=False)
        continues = zeros.index_put((ids,), prefixes[real])[1:]
        span_starts, span_lengths = starts[1:], lengths[1:]
        prefix_lengths = torch.where(continues > 0, lengths[continues], 0)
        buckets = [bucket for kind in (continues > 0, continues == 0) for bucket in _length_buckets(span_lengths, kind)]
        keys = prefix_lengths + span_lengths
        pairs = sum(len(bucket) * int(span_lengths[bucket].max()) * int(keys[bucket].max()) for bucket in buckets)
        if rows * width * width - pairs < min_pairs_saved * len(ids):
            return None
        prefix_starts = starts[continues]
        return cls([_span_batch(span_starts[bucket], span_lengths[bucket], prefix_starts[bucket],
                                prefix_lengths[bucket]) for bucket in buckets])


def _length_buckets(lengths: torch.Tensor, chosen: torch.Tensor) -> list[torch.Tensor]:
    """The indices of the `chosen` spans, longest first, cut into runs whose longest is at most
    `LENGTH_BUCKET` times their shortest."""
    order = torch.nonzero(chosen).flatten()
    order = order[torch.argsort(lengths[order], descending=True, stable=True)].tolist()
    buckets: list[list[int]] = []
    for index in order:
        if not buckets or int(lengths[buckets[-1][0]]) > LENGTH_BUCKET * int(lengths[index]):
            buckets.append([])
        buckets[-1].append(index)
    return [torch.tensor(bucket, dtype=torch.long, device=lengths.device) for bucket in buckets]


def _span_batch(starts: torch.Tensor, lengths: torch.Tensor, prefix_starts: torch.Tensor,
                prefix_lengths: torch.Tensor) -> _SpanBatch:
    query = torch.arange(int(lengths.max()), device=starts.device)
    real = query[None] < lengths[:, None]
    key = torch.arange(int((prefix_lengths + lengths).max()), device=starts.device)
    in_prefix = key[None] < prefix_lengths[:, None]
    own = key[None] - prefix_lengths[:, None]  # the key's index in the span itself
    key_real = in_prefix | ((own >= 0) & (own < lengths[:, None]))
    # a padded key reads the span's first token (masked out): past its end may lie past the batch's
    keys = torch.where(in_prefix, prefix_starts[:, None] + key[None], starts[:, None] + own.clamp(min=0))
    keys = torch.where(key_real, keys, starts[:, None])
    queries = torch.where(real, starts[:, None] + query[None], 0)
    if not bool(prefix_lengths.any()):  # causal over each span's own keys, its padding after them
        return _SpanBatch(queries, real, keys, None, queries[real])
    sees = key_real[:, None, :] & (in_prefix[:, None, :] | (own[:, None, :] <= query[None, :, None]))
    return _SpanBatch(queries, real, keys, (sees | ~real[:, :, None])[:, None], queries[real])


def span_inputs(spans: SharedPrefixSpans, rows: int, width: int) -> dict:
    """A forward's attention inputs for attending by `spans`: the spans, and for its mask a
    [rows, 1, width, width] view of one element. Given no mask, transformers builds a dense one from
    the packed positions (a new sequence wherever they restart), width x width bytes a row that
    attention by spans never reads; given a 4-D mask it builds none."""
    device = spans.batches[0].queries.device
    unread = torch.ones((), dtype=torch.bool, device=device).expand(rows, 1, width, width)
    return {"attention_mask": unread, "shared_spans": spans}


def span_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask, dropout: float = 0.0, scaling: float | None = None,
                   shared_spans: SharedPrefixSpans | None = None, **kwargs):
    """[B, heads, T, D] in, [B, T, heads, D] out, as HF attention functions; SDPA's own forward
    where the micro-batch has no `shared_spans`."""
    if shared_spans is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return attend_spans(module, query, key, value, shared_spans, dropout, scaling), None


def attend_spans(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 shared_spans: SharedPrefixSpans, dropout: float = 0.0, scaling: float | None = None) -> torch.Tensor:
    """[B, heads, T, D] in (keys and values may have fewer heads), [B, T, heads, D] out: each span's
    queries attend to its shared prompt's keys and its own."""
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    flat_q, flat_k, flat_v = (x.transpose(1, 2).reshape(batch * length, x.shape[1], dim) for x in (query, key, value))
    out = query.new_zeros(batch * length, heads, dim)
    for spans in shared_spans.batches:
        count, width = spans.queries.shape
        q = flat_q[spans.queries.flatten()].view(count, width, heads, dim).transpose(1, 2)
        k, v = (x[spans.keys.flatten()].view(count, -1, kv_heads, dim).transpose(1, 2) for x in (flat_k, flat_v))
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=spans.mask, is_causal=spans.mask is None,
                                                  scale=scaling, dropout_p=dropout if module.training else 0.0,
                                                  enable_gqa=kv_heads != heads)
        out = out.index_copy(0, spans.targets, attended.transpose(1, 2)[spans.real])
    return out.view(batch, length, heads, dim)


def apply_span_attention(model: nn.Module) -> None:
    """Let `model`'s SDPA attention take `shared_spans` where it runs SDPA over full causal layers
    (a vision-language model, sliding-window layers or another implementation keep their own,
    and packed shared prompts a dense mask). SDPA's entry in transformers' attention interface
    becomes `span_attention`, which is SDPA itself for every call without `shared_spans`."""
    config = model.config
    sliding = "sliding_attention" in (getattr(config, "layer_types", None) or ())
    if config._attn_implementation == "sdpa" and not sliding and not hasattr(config, "vision_config"):
        AttentionInterface.register("sdpa", span_attention)
        model.span_attention = True


def uses_span_attention(model: nn.Module) -> bool:
    return getattr(model, "span_attention", False)
