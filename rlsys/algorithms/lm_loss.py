"""Next-token log-probs and the token-sum language-modelling loss."""

from __future__ import annotations

import torch
from torch import nn


def token_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """log p(input_ids[:, t] | input_ids[:, :t]) for t >= 1, shape [B, T-1], in fp32."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    return logprobs_of_labels(logits, input_ids)


def logprobs_of_labels(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-prob of labels[:, t] under logits[:, t-1]; labels are aligned with the inputs."""
    logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logprobs.gather(-1, labels[:, 1:].unsqueeze(-1)).squeeze(-1)


def masked_nll_sum(logprobs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Sum of -log p over target tokens; loss_mask is [B, T] aligned with the inputs."""
    return -(logprobs * loss_mask[:, 1:]).sum()
