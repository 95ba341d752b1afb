"""Context parallelism, Ulysses style: each context-parallel rank holds a contiguous
chunk of every sequence; attention, the one place tokens meet, trades the split with
two all-to-alls: sequence-split, all heads -> all tokens, 1/cp of the heads -> attention
-> back. Everything else (norms, MLP, LM head, loss) runs on the rank's own chunk.

It needs no attention kernel support, so it runs on CPU (PyTorch's ring attention has
no CPU kernels). It is registered with transformers' AttentionInterface under
"ulysses" and selected per model; causal attention over the gathered sequence needs no
padding mask because batches are right-padded. A packed micro-batch (`rlsys.data.packing`)
brings its spans over the whole sequence (`rlsys.parallel.span_attention`), which the gathered
heads attend by. Which tokens a rank holds, and how its per-token outputs are put back in order:
`rlsys.parallel.rank_sequence`.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers import AttentionInterface

from rlsys.parallel.span_attention import SharedPrefixSpans, attend_spans, layer_window

log = logging.getLogger(__name__)

ATTENTION = "ulysses"


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Route `model`'s attention through the all-to-all over `cp_mesh`."""
    group = cp_mesh.get_group()
    for module in model.modules():
        if hasattr(module, "o_proj") and hasattr(module, "q_proj"):
            module.cp_group = group
    model.config._attn_implementation = ATTENTION
    model.span_attention = True  # packed micro-batches attend by spans (`uses_span_attention`)
    log.info("context parallel over %d ranks (Ulysses all-to-all attention)", cp_mesh.size())


def ulysses_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      shared_spans: SharedPrefixSpans | None = None, **kwargs):
    """[B, heads, T/cp, D] per rank in, [B, T/cp, heads, D] out, as HF attention functions:
    causal over the gathered sequence (`attention_mask` None), or by a packed micro-batch's
    `shared_spans` over the whole sequence (its `attention_mask` then an unread placeholder). A
    sliding-window layer attends by spans within its window, the gathered rows each a span where
    they are not packed."""
    window = layer_window(module, kwargs)
    group = module.cp_group
    query, key, value = (_seq_to_heads(t, group) for t in (query, key, value))
    dropout = dropout if module.training else 0.0
    if shared_spans is None and window:
        shared_spans = SharedPrefixSpans.of_whole_rows(query.shape[0], query.shape[2], query.device)
    if shared_spans is not None:
        out = attend_spans(module, query, key, value, shared_spans, dropout, scaling, window).transpose(1, 2)
    else:
        repeats = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                             is_causal=attention_mask is None, scale=scaling, dropout_p=dropout)
    return _heads_to_seq(out, group).transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, ulysses_attention)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0 (chunk i to rank i), with the same exchange as its
    backward. torch.distributed.nn's all_to_all falls back to scatters on gloo that
    treat group ranks as global ones, which breaks on any subgroup but the first."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def _seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[B, H, T/cp, D] -> [B, H/cp, T, D]: rank i receives head group i of every chunk."""
    size = dist.get_world_size(group)
    batch, heads, chunk, dim = x.shape
    parts = x.view(batch, size, heads // size, chunk, dim).transpose(0, 1)
    received = _AllToAll.apply(parts, group)  # [cp (source chunk), B, H/cp, T/cp, D]
    return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // size, size * chunk, dim)


def _heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """[B, H/cp, T, D] -> [B, H, T/cp, D]: the inverse of `_seq_to_heads`."""
    size = dist.get_world_size(group)
    batch, local_heads, length, dim = x.shape
    parts = x.view(batch, local_heads, size, length // size, dim).permute(2, 0, 1, 3, 4)
    received = _AllToAll.apply(parts, group)  # [cp (source head group), B, H/cp, T/cp, D]
    return received.transpose(0, 1).reshape(batch, size * local_heads, length // size, dim)
