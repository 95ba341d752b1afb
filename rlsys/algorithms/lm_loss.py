"""Next-token log-probs and the language-modelling loss, as pure loss functions
for a rank's model (`rlsys.trainer.rank_model`).

A loss builder returns a `functools.partial` of a module-level function rather than a
closure: Ray pickles the loss for every call, a closure by value, a partial by reference."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from rlsys.data.batching import Batch


@dataclass
class LossOutput:
    """What a loss function gives the rank's model for one micro-batch."""

    loss: torch.Tensor | None
    """This micro-batch's share of the global loss (None when only outputs are wanted)."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """Scalar shares of global metrics: they add up over micro-batches and data-parallel ranks."""
    rows: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-row outputs, [rows, T] aligned with input_ids."""


LossFn = Callable[[torch.Tensor, Batch], LossOutput]


def token_level(loss_fn: LossFn) -> LossFn:
    """Mark a loss function whose loss, metrics and rows are all sums or values over tokens:
    the rank's model may then take it on packed rows of several sequences (`rlsys.data.packing`). A
    term taken per row (a sequence's mean) would mix the sequences packed into a row, so any
    other loss gets the packed forward's logits laid back out as its rows."""
    loss_fn.token_level = True
    return loss_fn


def is_token_level(loss_fn: LossFn) -> bool:
    return getattr(loss_fn, "token_level", False)


def logprobs_of_labels(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-prob of labels[:, t] under logits[:, t-1], shape [B, T-1], fp32.

    Vocabulary-sharded logits (a DTensor under loss parallel, inside its context)
    take the log-softmax shard by shard: only per-token maxima and sums cross ranks."""
    if isinstance(logits, DTensor):
        logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        nll = F.nll_loss(logprobs.flatten(0, 1), labels[:, 1:].flatten(), reduction="none")
        return -nll.full_tensor().view(labels.shape[0], -1)
    # not log_softmax: its [B, T, vocab] output would be kept for backward beside the logits
    logits = logits[:, :-1].float()
    return logits.gather(-1, labels[:, 1:].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def logprobs_at(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Log-probs [B, T-1, k] of the k tokens ids[:, t] under logits[:, t-1], fp32 (as
    `logprobs_of_labels`, for k candidate tokens a position). Vocabulary-sharded logits take one
    sharded nll_loss per candidate."""
    ids = ids[:, 1:]
    if isinstance(logits, DTensor):
        logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1).flatten(0, 1)
        columns = [-F.nll_loss(logprobs, ids[..., j].flatten(), reduction="none").full_tensor()
                   for j in range(ids.shape[-1])]
        return torch.stack(columns, -1).view(ids.shape)
    logits = logits[:, :-1].float()
    return logits.gather(-1, ids) - torch.logsumexp(logits, dim=-1, keepdim=True)


def sampling_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The logits the engine sampled from: divided by the sampling temperature, as vLLM does
    (and VeRL's trainer), so log-probs, ratios and entropy are those of the sampling policy.
    Greedy decoding (temperature 0) leaves them as they are."""
    return logits / temperature if temperature not in (0.0, 1.0) else logits


def entropy_from_logits(logits: torch.Tensor, chunk_elements: int = 1 << 24) -> torch.Tensor:
    """Per-token entropy [B, T], over rows of at most `chunk_elements` logits at a time (at
    least one row): the softmax temporaries of a whole micro-batch over a 150k vocabulary
    outweigh the model's activations, while a small vocabulary is best done in one piece."""
    rows = max(1, chunk_elements // max(1, logits[0].numel()))
    return torch.cat([_entropy(chunk) for chunk in logits.split(rows)])


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return -(logprobs.exp() * logprobs).sum(-1)


def masked_nll_sum(logprobs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Sum of -log p over target tokens; loss_mask is [B, T] aligned with the inputs."""
    return -(logprobs * loss_mask[:, 1:]).sum()


def nll_loss(num_global_targets: int) -> LossFn:
    """Pretrain/SFT: mean negative log-likelihood over the global batch's target tokens."""
    return token_level(partial(_nll_loss, num_global_targets=num_global_targets))


def _nll_loss(logits: torch.Tensor, micro: Batch, *, num_global_targets: int) -> LossOutput:
    logprobs = logprobs_of_labels(logits, micro["input_ids"].to(logits.device))
    loss = masked_nll_sum(logprobs, micro["loss_mask"].to(logprobs.device)) / num_global_targets
    return LossOutput(loss, {"loss": loss})


def token_logprobs(temperature: float = 1.0) -> LossFn:
    """Forward only: per-token log-probs [B, T] aligned with input_ids (column 0 is 0), at the
    sampling temperature."""
    return token_level(partial(_token_logprobs, temperature=temperature))


def _token_logprobs(logits: torch.Tensor, micro: Batch, *, temperature: float) -> LossOutput:
    logprobs = logprobs_of_labels(sampling_logits(logits, temperature), micro["input_ids"].to(logits.device))
    return LossOutput(None, rows={"logprobs": F.pad(logprobs, (1, 0))})


def logprobs_and_sum_pi_squared(temperature: float = 1.0) -> LossFn:
    """Forward only: `token_logprobs`' rows and, aligned the same way, each position's sum over the
    vocabulary of the squared probabilities of the next token ("sum_pi_squared", VeRL's sum_pi_squared:
    what the optimal-token-baseline estimators read)."""
    return token_level(partial(_logprobs_and_sum_pi_squared, temperature=temperature))


def _logprobs_and_sum_pi_squared(logits: torch.Tensor, micro: Batch, *, temperature: float) -> LossOutput:
    logits = sampling_logits(logits, temperature)
    logprobs = logprobs_of_labels(logits, micro["input_ids"].to(logits.device))
    squared = torch.softmax(logits[:, :-1].float(), dim=-1).square().sum(-1)
    if isinstance(squared, DTensor):  # a vocabulary-parallel sum: every rank holds the whole
        squared = squared.full_tensor()
    return LossOutput(None, rows={"logprobs": F.pad(logprobs, (1, 0)), "sum_pi_squared": F.pad(squared, (1, 0))})


def top_k_logprobs(k: int) -> LossFn:
    """Forward only, at temperature 1: per-token log-probs [B, T] as `token_logprobs`, and at each
    position the k most likely tokens and their log-probs, [B, T, k] ("top_ids", "top_logprobs",
    column 0 zero: nothing predicts the first token)."""
    return token_level(partial(_top_k_logprobs, k=k))


def _top_k_logprobs(logits: torch.Tensor, micro: Batch, *, k: int) -> LossOutput:
    labels = micro["input_ids"].to(logits.device)
    if isinstance(logits, DTensor):  # the whole vocabulary on every rank: top-k crosses the shards
        logits = logits.full_tensor()
    logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    sampled = logprobs.gather(-1, labels[:, 1:].unsqueeze(-1)).squeeze(-1)
    return LossOutput(None, rows={"logprobs": F.pad(sampled, (1, 0)),
                                  "top_ids": F.pad(top_ids, (0, 0, 1, 0)),
                                  "top_logprobs": F.pad(top_logprobs, (0, 0, 1, 0))})
