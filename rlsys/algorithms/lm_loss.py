"""Next-token log-probs and the language-modelling loss, as pure loss functions
for the model engine (`rlsys.engine.model_engine`).

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
    """What a loss function gives the engine for one micro-batch."""

    loss: torch.Tensor | None
    """This micro-batch's share of the global loss (None when only outputs are wanted)."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """Scalar shares of global metrics: they add up over micro-batches and data-parallel ranks."""
    rows: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-row outputs, [rows, T] aligned with input_ids."""


LossFn = Callable[[torch.Tensor, Batch], LossOutput]


def token_level(loss_fn: LossFn) -> LossFn:
    """Mark a loss function whose loss, metrics and rows are all sums or values over tokens:
    the engine may then pack several sequences into one row (`rlsys.data.packing`). A term
    taken per row (a sequence's mean) would mix the sequences packed into it."""
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
