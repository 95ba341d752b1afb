"""Attention over packed spans, each a sequence or a part of one continuing the spans before it
in its tree (`rlsys.data.packing`: a shared prompt, then each sample), computed span by span
instead of over a row's whole width: the attention of every packed micro-batch, and of unpacked
rows under sequence parallel.

A packed row holds several sequences, and rows whose contexts begin alike are laid out as a tree:
a span for what they share, then a span for each part where they differ. A dense block-causal
mask over the row would score every pair of its W columns (W x W, however short its sequences)
and keep a GPU off its flash kernels. Here each span's queries attend to its ancestors' keys
and its own, nothing else: the scores a span computes are the ones its tokens use. Spans are
gathered into batches of like spans (those continuing others, those that do not) of like lengths
(`LENGTH_BUCKET`), padded to the longest of each, and run through PyTorch's
scaled_dot_product_attention: causal without a mask where a span continues nothing (its padding
lies after its last query), with each span's own [queries x keys] mask where it continues others.
On a GPU in half precision every span goes instead through PyTorch's flash variable-length kernel in
one call, unpadded (`varlen_kernel`). A sliding-window layer narrows each batch's mask to its
window (a key's position in its sequence is its index among the span's keys), through SDPA on
every device. The outputs are scattered back to the packed positions. Every token sees exactly
what it sees in its own unpacked row.

It takes SDPA's entry in transformers' attention interface (`apply_span_attention`, for a model
whose attention is SDPA over causal layers, full or sliding-window) and is SDPA itself for every
call without `shared_spans` (and for a vision tower's layers, which are not causal). A model it
cannot take (other kinds of layer, another attention implementation) is not packed
(`uses_span_attention`).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from rlsys.data.packing import index_within_runs, span_ancestors

LENGTH_BUCKET = 1.25
"""Spans batched together differ in length by at most this factor, so that padding a span to its
batch's longest costs at most (1.25^2 - 1) of its own attention, or by at most `LENGTH_SLACK`."""

LENGTH_SLACK = 32
"""Short spans are batched with any up to this many tokens longer: padding them costs little
beside another attention call for each batch in every layer."""

WINDOW_TILE = 128
"""A sliding-window layer attends each span's queries in tiles of this many, each with only the
keys its window reaches: its masks and work grow with the span's length, not its square."""


@dataclass
class _SpanBatch:
    """Like spans, padded to the longest: where their queries and keys sit in the flattened
    [rows x width] positions, and which key each query sees."""
    queries: torch.Tensor
    """[S, Lq] flat position of each span's i-th token (0 where the span is shorter)."""
    picked: torch.Tensor
    """[real queries]: each real query's index in the flattened [S x Lq]."""
    keys: torch.Tensor
    """[S, Lk] flat position of each key: its ancestors', then the span's own."""
    mask: torch.Tensor | None
    """[S, 1, Lq, Lk] bool: what each query sees (a padded query sees something, to stay finite);
    None where no span continues another: each query sees its own span causally."""
    targets: torch.Tensor
    """[real queries]: their flat positions, in `picked`'s order."""
    real: torch.Tensor
    """[S, Lq] bool: the span has a token at the query."""
    query_positions: torch.Tensor
    """[S, Lq]: each query's position in its sequence (its ancestors' tokens come before it). A
    key's position is its index in `keys`: a span's ancestors and itself are its sequence's
    tokens up to its end, in order."""

    def windowed(self, window: int) -> torch.Tensor:
        """`mask` narrowed to a sliding window: a query sees the keys fewer than `window` positions
        before it (transformers' `sliding_window_overlay`), itself included."""
        key = torch.arange(self.keys.shape[1], device=self.keys.device)
        near = self.query_positions[:, :, None] - key[None, None, :] < window
        sees = self.mask[:, 0] if self.mask is not None else key[None, None, :] <= self.query_positions[:, :, None]
        return ((sees & near) | ~self.real[:, :, None])[:, None]


@dataclass
class _Varlen:
    """Every span at once, for a variable-length attention kernel: the real queries span by span,
    and each span's keys (its ancestors', then its own) laid end to end."""
    queries: torch.Tensor
    """[real queries]: their flat positions, span by span."""
    keys: torch.Tensor
    """[keys]: the flat position of each span's keys, span by span."""
    query_offsets: torch.Tensor
    """[spans + 1] int32: where each span's queries start in `queries` (cumulative lengths)."""
    key_offsets: torch.Tensor
    """[spans + 1] int32: where each span's keys start in `keys`."""
    longest_queries: int
    longest_keys: int


class SharedPrefixSpans:
    """The spans of a packed micro-batch (`of`): where each starts and how long it is, and the keys
    of the spans it continues. Laid out on first use, on the host, then moved to `device`: as
    batches of like spans for SDPA (`batches`), or end to end for a variable-length kernel
    (`varlen`); a forward builds only the layout its kernel reads."""

    def __init__(self, starts: torch.Tensor, lengths: torch.Tensor, prefix_positions: torch.Tensor,
                 prefix_offsets: torch.Tensor, prefix_lengths: torch.Tensor, device: torch.device | str = "cpu"):
        self.starts, self.lengths = starts, lengths
        """[spans]: each span's first flat position in the [rows x width] micro-batch, and its length."""
        self.prefix_positions = prefix_positions
        """The flat positions of every span's ancestors' tokens, span by span, root first."""
        self.prefix_offsets, self.prefix_lengths = prefix_offsets, prefix_lengths
        """[spans]: where each span's ancestors' positions start in `prefix_positions`, and how many
        (0: the span continues none)."""
        self.device = torch.device(device)
        self._tiles: dict[int, SharedPrefixSpans] = {}
        self._windowed_masks: dict[int, list[torch.Tensor]] = {}

    def to(self, device: torch.device | str) -> SharedPrefixSpans:
        return SharedPrefixSpans(self.starts, self.lengths, self.prefix_positions, self.prefix_offsets,
                                 self.prefix_lengths, device)

    @functools.cached_property
    def batches(self) -> list[_SpanBatch]:
        """Like spans, each batch padded to its longest (`_buckets`)."""
        batches = [_span_batch(self.starts[bucket], self.lengths[bucket], self.prefix_positions,
                               self.prefix_offsets[bucket], self.prefix_lengths[bucket])
                   for bucket in _buckets(self.lengths, self.prefix_lengths)]
        return [_SpanBatch(**_moved(batch, self.device)) for batch in batches]

    def windowed(self, window: int) -> SharedPrefixSpans:
        """The spans as a sliding-window layer attends them (built once a window: every sliding layer
        reads it): each span's queries in tiles of `WINDOW_TILE`, each tile continuing the
        `window - 1` keys before its first query (its span's ancestors' or its own)."""
        if window not in self._tiles:
            self._tiles[window] = SharedPrefixSpans(*_tiles(self, window), device=self.device)
        return self._tiles[window]

    def windowed_masks(self, window: int) -> list[torch.Tensor]:
        """Each batch's mask narrowed to a sliding `window` (built once a window)."""
        if window not in self._windowed_masks:
            self._windowed_masks[window] = [batch.windowed(window) for batch in self.batches]
        return self._windowed_masks[window]

    @functools.cached_property
    def longest_keys(self) -> int:
        """The most keys any span attends to: its ancestors' tokens and its own."""
        return int((self.prefix_lengths + self.lengths).max())

    @functools.cached_property
    def targets(self) -> torch.Tensor:
        """Every real query's flat position, the batches' in turn."""
        return torch.cat([batch.targets for batch in self.batches])

    @functools.cached_property
    def varlen(self) -> _Varlen:
        return _Varlen(**_moved(_varlen(self.starts, self.lengths, self.prefix_positions, self.prefix_offsets,
                                        self.prefix_lengths), self.device))

    @staticmethod
    @functools.lru_cache(maxsize=2)
    def of_whole_rows(rows: int, width: int, device: torch.device) -> SharedPrefixSpans:
        """Right-padded rows attended causally over their whole width, each a span: padding comes after
        every real token, so no real query sees it. Shared by every layer and micro-batch of that
        shape (with the windows' tiles and masks it builds)."""
        return SharedPrefixSpans.of_rows(torch.ones(rows, width, dtype=torch.long)).to(device)

    @classmethod
    def of_rows(cls, attention_mask: torch.Tensor) -> SharedPrefixSpans:
        """Unpacked right-padded rows ([rows, width], 1 for a token), each a span of its own (a
        row without tokens none)."""
        present = attention_mask.bool().any(1)
        return cls.of(attention_mask.long() * (present.long().cumsum(0) * present)[:, None])

    @classmethod
    def of(cls, segment_ids: torch.Tensor, prefix_ids: torch.Tensor | None = None) -> SharedPrefixSpans:
        """The spans of a packed micro-batch: `segment_ids` from 1 per span, 0 for padding;
        `prefix_ids` the segment a span continues, 0 for none (None: no span continues one)."""
        rows, width = segment_ids.shape
        segments = segment_ids.flatten()
        real = segments > 0
        if not bool(real.any()):
            raise ValueError("a micro-batch without tokens has no spans to attend")
        ids, positions = segments[real], torch.arange(rows * width, device=segments.device)[real]
        zeros = torch.zeros(int(ids.max()) + 1, dtype=torch.long, device=ids.device)
        lengths = zeros.index_add(0, ids, torch.ones_like(ids))
        starts = zeros.scatter_reduce(0, ids, positions, "amin", include_self=False)
        chains = span_ancestors(segment_ids, prefix_ids) if prefix_ids is not None and bool(prefix_ids.any()) \
            else [[]] * len(zeros)
        pairs = torch.tensor([(span, ancestor) for span, chain in enumerate(chains) for ancestor in chain],
                             dtype=torch.long, device=ids.device).view(-1, 2)
        sizes = lengths[pairs[:, 1]]
        prefix_positions = starts[pairs[:, 1]].repeat_interleave(sizes) + index_within_runs(sizes)
        prefix_lengths = zeros.index_add(0, pairs[:, 0], sizes)
        prefix_offsets = prefix_lengths.cumsum(0) - prefix_lengths
        return cls(starts[1:], lengths[1:], prefix_positions, prefix_offsets[1:], prefix_lengths[1:])


def _tiles(spans: SharedPrefixSpans, window: int) -> tuple[torch.Tensor, ...]:
    """`SharedPrefixSpans`' fields of `spans` cut into tiles of `WINDOW_TILE` queries, each tile's
    keys before it the `window - 1` keys before its first query in its span's key order (its
    ancestors', then its own: a key's index there is its position in its sequence)."""
    starts, lengths, before = [], [], []
    for start, length, offset, prefix in zip(*(x.tolist() for x in (spans.starts, spans.lengths,
                                                                      spans.prefix_offsets, spans.prefix_lengths))):
        keys = torch.cat([spans.prefix_positions[offset:offset + prefix], start + torch.arange(length)])
        for first in range(0, length, WINDOW_TILE):
            position = prefix + first
            starts.append(start + first)
            lengths.append(min(WINDOW_TILE, length - first))
            before.append(keys[max(0, position - window + 1):position])
    prefix_lengths = torch.tensor([len(keys) for keys in before], dtype=torch.long)
    return (torch.tensor(starts, dtype=torch.long), torch.tensor(lengths, dtype=torch.long), torch.cat(before),
            prefix_lengths.cumsum(0) - prefix_lengths, prefix_lengths)


def _moved(layout, device: torch.device) -> dict:
    """A layout dataclass's fields, its tensors on `device`."""
    return {name: value.to(device) if isinstance(value, torch.Tensor) else value
            for name, value in vars(layout).items()}


def _varlen(starts: torch.Tensor, lengths: torch.Tensor, prefix_positions: torch.Tensor,
            prefix_offsets: torch.Tensor, prefix_lengths: torch.Tensor) -> _Varlen:
    """The spans end to end: each span's queries, and its keys (its ancestors', then its own)."""
    key_lengths = prefix_lengths + lengths
    query_offsets, key_offsets = (F.pad(x.cumsum(0), (1, 0)) for x in (lengths, key_lengths))
    query_span = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)
    queries = starts[query_span] + torch.arange(len(query_span), device=lengths.device) - query_offsets[query_span]
    key_span = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), key_lengths)
    key = torch.arange(len(key_span), device=lengths.device) - key_offsets[key_span]  # within the span's keys
    in_prefix = key < prefix_lengths[key_span]
    keys = torch.where(in_prefix, _prefix_keys(prefix_positions, prefix_offsets[key_span] + key),
                       starts[key_span] + key - prefix_lengths[key_span])
    return _Varlen(queries, keys, query_offsets.int(), key_offsets.int(), int(lengths.max()), int(key_lengths.max()))


def _prefix_keys(prefix_positions: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """`prefix_positions[at]`, 0 where `at` is past them (a key that is not an ancestor's: unread)."""
    return F.pad(prefix_positions, (0, 1))[at.clamp(max=len(prefix_positions))]


def _buckets(lengths: torch.Tensor, prefix_lengths: torch.Tensor) -> list[torch.Tensor]:
    """The spans' indices in batches of one kind (continuing others or not), longest prefix then
    longest span first, the spans of a batch differing in their own length and in their prefix's
    by at most `LENGTH_BUCKET` times or `LENGTH_SLACK` tokens (`_close`)."""
    order = torch.argsort(prefix_lengths * (int(lengths.max()) + 1) + lengths, descending=True, stable=True)
    buckets: list[tuple[list[int], tuple[int, int], tuple[int, int]]] = []  # (spans, shortest, longest)
    for index in order.tolist():
        sizes = (int(lengths[index]), int(prefix_lengths[index]))
        if buckets:
            members, low, high = buckets[-1]
            same_kind = (sizes[1] > 0) == (low[1] > 0)  # continuing others or not
            low, high = tuple(map(min, low, sizes)), tuple(map(max, high, sizes))
            if same_kind and all(map(_close, low, high)):
                buckets[-1] = (members + [index], low, high)
                continue
        buckets.append(([index], sizes, sizes))
    return [torch.tensor(members, dtype=torch.long, device=lengths.device) for members, _, _ in buckets]


def _close(shortest: int, longest: int) -> bool:
    return longest <= max(LENGTH_BUCKET * shortest, shortest + LENGTH_SLACK)


def _span_batch(starts: torch.Tensor, lengths: torch.Tensor, prefix_positions: torch.Tensor,
                prefix_offsets: torch.Tensor, prefix_lengths: torch.Tensor) -> _SpanBatch:
    query = torch.arange(int(lengths.max()), device=starts.device)
    real = query[None] < lengths[:, None]
    key = torch.arange(int((prefix_lengths + lengths).max()), device=starts.device)
    in_prefix = key[None] < prefix_lengths[:, None]
    own = key[None] - prefix_lengths[:, None]  # the key's index in the span itself
    key_real = in_prefix | ((own >= 0) & (own < lengths[:, None]))
    # a padded key reads the span's first token (masked out): past its end may lie past the batch's
    keys = torch.where(in_prefix, _prefix_keys(prefix_positions, prefix_offsets[:, None] + key[None]),
                       starts[:, None] + own.clamp(min=0))
    keys = torch.where(key_real, keys, starts[:, None])
    queries = torch.where(real, starts[:, None] + query[None], 0)
    picked = torch.nonzero(real.flatten()).flatten()
    positions = prefix_lengths[:, None] + query[None]
    if not bool(prefix_lengths.any()):  # causal over each span's own keys, its padding after them
        return _SpanBatch(queries, picked, keys, None, queries[real], real, positions)
    sees = key_real[:, None, :] & (in_prefix[:, None, :] | (own[:, None, :] <= query[None, :, None]))
    return _SpanBatch(queries, picked, keys, (sees | ~real[:, :, None])[:, None], queries[real], real, positions)


def span_inputs(spans: SharedPrefixSpans, rows: int, width: int) -> dict:
    """A forward's attention inputs for attending by `spans`: the spans, and for its mask a
    [rows, 1, width, width] view of one element. Given no mask, transformers builds a dense one from
    the packed positions (a new sequence wherever they restart), width x width bytes a row that
    attention by spans never reads; given a 4-D mask it builds none."""
    unread = torch.ones((), dtype=torch.bool, device=spans.device).expand(rows, 1, width, width)
    return {"attention_mask": unread, "shared_spans": spans}


def span_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask, dropout: float = 0.0, scaling: float | None = None,
                   shared_spans: SharedPrefixSpans | None = None, **kwargs):
    """[B, heads, T, D] in, [B, T, heads, D] out, as HF attention functions; SDPA's own forward
    where the micro-batch has no `shared_spans` and for a layer that is not causal (a vision
    tower's, which the forward passes them on to). A sliding-window layer passes its `sliding_window`."""
    if shared_spans is None or not getattr(module, "is_causal", True):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return attend_spans(module, query, key, value, shared_spans, dropout, scaling, layer_window(module, kwargs)), None


def layer_window(module: nn.Module, kwargs: dict) -> int | None:
    """The sliding window of the attention layer `module` (None: it sees every key before a query), as
    its forward passes it to the attention function or, in families whose forward does not
    (Qwen2-MoE), as the layer keeps it."""
    return kwargs.get("sliding_window") or getattr(module, "sliding_window", None) or None


def attend_spans(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 shared_spans: SharedPrefixSpans, dropout: float = 0.0, scaling: float | None = None,
                 window: int | None = None) -> torch.Tensor:
    """[B, heads, T, D] in (keys and values may have fewer heads), [B, T, heads, D] out: each span's
    queries attend to its ancestors' keys and its own, within `window` positions before them for a
    sliding-window layer (through SDPA's masks on every device)."""
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    flat_q, flat_k, flat_v = (x.transpose(1, 2).reshape(batch * length, x.shape[1], dim) for x in (query, key, value))
    dropout = dropout if module.training else 0.0
    if window and window >= shared_spans.longest_keys:  # the window holds every span whole
        window = None
    kernel = varlen_kernel(query) if dropout == 0.0 and not window else None
    if kernel is not None:  # every span in one call, no padding
        varlen = shared_spans.varlen
        out = kernel(flat_q[varlen.queries], flat_k[varlen.keys], flat_v[varlen.keys], varlen.query_offsets,
                     varlen.key_offsets, varlen.longest_queries, varlen.longest_keys, scale=scaling,
                     window_size=(-1, 0), enable_gqa=kv_heads != heads)
        out = query.new_zeros(batch * length, heads, dim).index_copy(0, varlen.queries, out)
        return out.view(batch, length, heads, dim)
    attended = []
    if window:
        shared_spans = shared_spans.windowed(window)
    masks = shared_spans.windowed_masks(window) if window else [spans.mask for spans in shared_spans.batches]
    for spans, mask in zip(shared_spans.batches, masks):
        count, width = spans.queries.shape
        q = flat_q[spans.queries.flatten()].view(count, width, heads, dim).transpose(1, 2)
        k, v = (x[spans.keys.flatten()].view(count, -1, kv_heads, dim).transpose(1, 2) for x in (flat_k, flat_v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                             scale=scaling, dropout_p=dropout, enable_gqa=kv_heads != heads)
        attended.append(out.transpose(1, 2).reshape(count * width, heads, dim)[spans.picked])
    out = query.new_zeros(batch * length, heads, dim).index_copy(0, shared_spans.targets, torch.cat(attended))
    return out.view(batch, length, heads, dim)


def varlen_kernel(query: torch.Tensor):
    """`flash_varlen` where PyTorch's flash variable-length kernel runs: CUDA on a GPU of compute
    capability 8.0 or above, half precision, a head size up to 256 in multiples of 8, a PyTorch that
    has `torch.nn.attention.varlen`; else None (SDPA by batches of like spans)."""
    dim = query.shape[-1]
    if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and dim % 8 == 0 and dim <= 256 \
            and _flash_varlen_runs(query.device.index):
        return flash_varlen
    return None


@functools.cache
def _flash_varlen_runs(device_index: int | None) -> bool:
    """Whether this PyTorch has the flash variable-length kernel for the GPU (asked once a device)."""
    if not torch.backends.cuda.is_flash_attention_available():
        return False
    if torch.cuda.get_device_capability(device_index) < (8, 0):
        return False
    try:
        from torch.nn.attention import varlen  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _keywords(function) -> frozenset[str]:
    """The parameter names `function` takes (read once a function: every layer calls the kernel)."""
    return frozenset(inspect.signature(function).parameters)


def flash_varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, query_offsets: torch.Tensor,
                 key_offsets: torch.Tensor, longest_queries: int, longest_keys: int, *, scale: float | None = None,
                 window_size: tuple[int, int] = (-1, 0), enable_gqa: bool = False) -> torch.Tensor:
    """PyTorch's `varlen_attn`, called as this PyTorch takes it (its keywords changed between
    releases: `is_causal` before `window_size`, no `scale` or `enable_gqa` at first). Causal over
    queries shorter than their keys, the diagonal ends at the last key: a span's queries see its
    ancestors whole and their own tokens causally."""
    from torch.nn.attention.varlen import varlen_attn

    assert window_size == (-1, 0), "span attention is causal"
    taken = _keywords(varlen_attn)
    kwargs = {"window_size": window_size} if "window_size" in taken else {"is_causal": True}
    if scale is not None and "scale" in taken:
        kwargs["scale"] = scale
    elif scale is not None:  # the kernel scales by 1 / sqrt(head size)
        query = query * (scale * query.shape[-1] ** 0.5)
    if enable_gqa and "enable_gqa" in taken:
        kwargs["enable_gqa"] = True
    elif enable_gqa:
        repeats = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
    return varlen_attn(query, key, value, query_offsets, key_offsets, longest_queries, longest_keys, **kwargs)


def apply_span_attention(model: nn.Module) -> None:
    """Let `model`'s SDPA attention take `shared_spans` where its language model runs SDPA over
    causal layers, full or sliding-window (other kinds of layer or another implementation keep
    their own, and their rows are not packed). SDPA's entry in transformers' attention interface
    becomes `span_attention`, which is SDPA itself for every call without `shared_spans` and for a
    vision tower's layers."""
    config = model.config.get_text_config()
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if config._attn_implementation == "sdpa" and kinds <= {"full_attention", "sliding_attention"}:
        AttentionInterface.register("sdpa", span_attention)
        model.span_attention = True


def uses_span_attention(model: nn.Module) -> bool:
    return getattr(model, "span_attention", False)
