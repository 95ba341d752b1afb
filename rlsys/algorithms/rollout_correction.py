"""The engine/trainer mismatch: how large it is, and the corrections against it.

The engine samples with its own kernels, so its probability of a token is not exactly the
trainer's, even with the same weights (bf16, fused kernels, another batch shape; under async RL
an older policy too). Every correction reads the ratio pi_old / pi_rollout of each response
token, the trainer's old log-prob against the engine's (VeRL's `rollout_correction`):

- truncated importance sampling (TIS): each token's policy-gradient loss weighted by
  min(ratio, threshold), or every token of a response by min(product of its ratios, threshold);
- rejection: tokens (token) or whole responses (sequence: the product of their ratios;
  geometric: their geometric mean) whose ratio lies outside [lower, upper] are dropped;
  token-level with both bounds is IcePop's two-sided mask; or VeRL's divergence criteria: a
  token's k1, k2 or k3 divergence, or a response's sum, mean or maximum of them, above a bound
  (k1: outside [lower, upper] on pi_rollout / pi_old); several criteria chained, each must pass;
- a veto: a response holding one token whose ratio is below a threshold is dropped whole.

A dropped token's loss is multiplied by 0; the loss keeps its normaliser (global token counts).
Log-ratios are clamped to +-20 before they are exponentiated.
"""

from __future__ import annotations

import math

import torch

from rlsys.algorithms.aggregation import masked
from rlsys.config.rl import RolloutCorrectionConfig

SAFE_LOG_RATIO = 20.0


def correction_factors(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                       cfg: RolloutCorrectionConfig, weight_mean: float = 1.0, weighted: bool = True
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """[B, T] factors for each token's policy-gradient loss (no gradient): importance weights
    (divided by `weight_mean`, the batch's mean weight when they are batch-normalised; logged but
    left out unless `weighted`) times 0 where a rejection or the veto drops the token; and [B, T]
    values whose mean over the response tokens is a metric (the weights, where truncation acted,
    where a token was dropped). Padding (NaN included) gets factor 1."""
    log_ratio = masked(old_logprobs.detach() - rollout_logprobs, mask)
    factors, metrics = torch.ones_like(log_ratio), {}
    if cfg.rollout_is != "none":
        factors, truncated = truncated_is_weights(log_ratio, mask, cfg.rollout_is, cfg.rollout_is_threshold)
        factors = factors / weight_mean
        metrics.update({"rollout_corr/is_weight": factors, "rollout_corr/truncated_frac": truncated})
        factors = factors if weighted else torch.ones_like(log_ratio)
    keep = torch.ones_like(log_ratio)
    bounds = rejection_bounds(cfg)
    for option, (lower, upper) in bounds.items():
        kept = rejection_keep(log_ratio, mask, option, lower, upper)
        if len(bounds) > 1:  # chained criteria: what each rejects
            metrics[f"rollout_corr/rejected_frac_{option}"] = 1 - kept
        keep = keep * kept
    if cfg.rollout_token_veto_threshold is not None:
        keep = keep * veto_keep(log_ratio, mask, cfg.rollout_token_veto_threshold)
    if cfg.rejections or cfg.rollout_token_veto_threshold is not None:
        metrics["rollout_corr/rejected_frac"] = 1 - keep
    return factors * keep, metrics


def rollout_is_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                       cfg: RolloutCorrectionConfig) -> torch.Tensor:
    """[B, T] the truncated importance weights of pi_old / pi_rollout at `cfg.rollout_is`'s level."""
    log_ratio = masked(old_logprobs - rollout_logprobs, mask)
    return truncated_is_weights(log_ratio, mask, cfg.rollout_is, cfg.rollout_is_threshold)[0]


def is_weight_mean(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                   cfg: RolloutCorrectionConfig) -> float:
    """The mean truncated importance weight over the batch's response tokens (`token`), or over its
    responses (`sequence`: one weight each), as VeRL's `rollout_is_batch_normalize` takes it."""
    weights = rollout_is_weights(old_logprobs, rollout_logprobs, mask, cfg)
    if cfg.rollout_is == "sequence":
        responses = mask.sum(-1) > 0
        return weights[:, 0][responses].mean().item()
    return masked(weights, mask).sum().item() / mask.sum().clamp(min=1).item()


def truncated_is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str,
                         threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] min(ratio, threshold) per token, or per response of its product of ratios, and
    where the truncation acted. `log_ratio` is 0 outside the mask."""
    if level == "sequence":
        log_ratio = _per_response(log_ratio.sum(-1), log_ratio)
    limit = math.log(threshold)
    return log_ratio.clamp(max=limit).exp(), (log_ratio > limit).float()


RATIO_REJECTIONS = ("token", "sequence", "geometric")
DIVERGENCE_REJECTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                         "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


def rejection_bounds(cfg: RolloutCorrectionConfig) -> dict[str, tuple[float | None, float]]:
    """Each rejection criterion's (lower, upper) bounds, read from `rollout_rs_threshold` as VeRL
    reads it (one value for all, or one per criterion; `lower_upper` for k1); a ValueError says
    what is wrong."""
    options = list(dict.fromkeys(cfg.rejections))
    known = RATIO_REJECTIONS + DIVERGENCE_REJECTIONS
    for option in options:
        if option not in known:
            raise ValueError(f"unknown rejection {option!r}; one of {', '.join(known)}")
    specs = [part.strip() for part in str(cfg.rollout_rs_threshold).split(",") if part.strip()]
    if len(specs) not in (1, len(options)):
        raise ValueError(f"rollout_rs_threshold: one value for all {len(options)} criteria, or one each")
    bounds = {}
    for option, spec in zip(options, specs * len(options) if len(specs) == 1 else specs):
        lower, upper = _bounds(option, spec, cfg.rollout_rs_threshold_lower)
        bounds[option] = (lower, upper)
    return bounds


def _bounds(option: str, spec: str, ratio_lower: float | None) -> tuple[float | None, float]:
    two_sided = option in RATIO_REJECTIONS or option.endswith("k1")
    if "_" in spec and not two_sided:
        raise ValueError(f"rollout_rs_threshold: {option} takes an upper bound alone, not {spec!r}")
    try:
        lower, upper = (float(v) for v in spec.split("_", 1)) if "_" in spec else (None, float(spec))
    except ValueError:
        raise ValueError(f"rollout_rs_threshold: {spec!r} is not a number (or lower_upper)") from None
    if upper <= 0 or (lower is not None and lower <= 0):
        raise ValueError(f"rollout_rs_threshold: {option}'s bounds must be positive, not {spec!r}")
    if option in RATIO_REJECTIONS:
        if upper <= 1:
            raise ValueError(f"rollout_rs_threshold: {option}'s upper bound on the ratio must be above 1, not {upper}")
        lower = lower or ratio_lower or 1 / upper
    elif two_sided:
        lower = lower or 1 / upper
    return lower, upper


def rejection_keep(log_ratio: torch.Tensor, mask: torch.Tensor, option: str, lower: float | None,
                   upper: float) -> torch.Tensor:
    """[B, T] 1 where the criterion passes, else 0; 1 on padding. token, sequence, geometric: the
    token's ratio, its response's product of ratios or their geometric mean within [lower, upper].
    VeRL's `<level>_k<n>`: the k-n divergence of the token (token), or its response's sum, mean or
    maximum of them, at most `upper` (k1: within [log lower, log upper])."""
    if option in RATIO_REJECTIONS:
        if option == "sequence":
            log_ratio = _per_response(log_ratio.sum(-1), log_ratio)
        elif option == "geometric":
            log_ratio = _per_response(log_ratio.sum(-1) / mask.sum(-1).clamp(min=1), log_ratio)
        inside = (log_ratio >= math.log(lower)) & (log_ratio <= math.log(upper))
        return torch.where(mask.bool(), inside.float(), 1.0)
    level, divergence = option.rsplit("_", 1)
    statistic = _divergence(log_ratio.clamp(-SAFE_LOG_RATIO, SAFE_LOG_RATIO), divergence)
    if level != "token":
        statistic = _per_sequence(statistic, mask, level).unsqueeze(-1).expand_as(log_ratio)
    if divergence == "k1":
        inside = (statistic >= math.log(lower)) & (statistic <= math.log(upper))
    else:
        inside = statistic <= upper
    return torch.where(mask.bool(), inside.float(), 1.0)


def _divergence(log_ratio: torch.Tensor, divergence: str) -> torch.Tensor:
    if divergence == "k1":
        return -log_ratio
    if divergence == "k2":
        return 0.5 * log_ratio.square()
    return torch.exp(log_ratio) - 1.0 - log_ratio


def _per_sequence(values: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """[B] each response's sum, mean or maximum of `values` over its tokens (0 for none)."""
    on = mask.bool()
    if level == "seq_max":
        largest = masked(values, on, float("-inf")).max(-1).values
        return torch.where(on.any(-1), largest, 0.0)
    total = masked(values, on).sum(-1)
    return total if level == "seq_sum" else total / (mask.sum(-1) + 1e-8)


def veto_keep(log_ratio: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """[B, T] 0 on every token of a response holding a token whose ratio is below `threshold`;
    1 on padding."""
    vetoed = masked(log_ratio < math.log(threshold), mask, False).any(-1, keepdim=True)
    return torch.where(mask.bool(), (~vetoed).float(), 1.0)


def _per_response(per_row: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return per_row.clamp(-SAFE_LOG_RATIO, SAFE_LOG_RATIO).unsqueeze(-1).expand_as(like)


def mismatch_metrics(trainer: torch.Tensor, engine: torch.Tensor,
                     tokens_per_sequence: list[int] | None = None) -> dict[str, float]:
    """How far apart the engine's and the trainer's log-probs of the same sampled tokens are, over
    1-D tensors of response tokens, both of the sampling policy: mean |difference|; the KL from the
    engine's policy to the trainer's, estimated from the engine's samples with k1 (its mean
    log-ratio) and k3 ((r - 1) - log r, r = pi_trainer / pi_engine, never negative); quantiles and
    maximum of |log r|; the share of tokens whose ratio lies outside [1/2, 2] (which a threshold of 2
    truncates or rejects). With `tokens_per_sequence` (the responses' token counts, in the order of
    the tokens), VeRL's sequence diagnostics too (`sequence_mismatch_metrics`)."""
    if trainer.numel() == 0:
        return {}
    log_ratio = (trainer - engine).double()
    size = log_ratio.abs()
    p50, p90, p99 = torch.quantile(size, torch.tensor([0.5, 0.9, 0.99], dtype=size.dtype)).tolist()
    sequences = sequence_mismatch_metrics(trainer.double(), engine.double(), tokens_per_sequence) \
        if tokens_per_sequence else {}
    return {**sequences,
        "rollout/logprob_abs_diff": size.mean().item(),
        "mismatch/kl_k1": (-log_ratio).mean().item(),
        "mismatch/kl_k3": (log_ratio.clamp(max=SAFE_LOG_RATIO).exp() - 1 - log_ratio).mean().item(),
        "mismatch/abs_log_ratio_p50": p50,
        "mismatch/abs_log_ratio_p90": p90,
        "mismatch/abs_log_ratio_p99": p99,
        "mismatch/abs_log_ratio_max": size.max().item(),
        "mismatch/ratio_outside_2x_frac": (size > math.log(2)).double().mean().item(),
    }


def _per_sequence_sums(tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Sums of consecutive runs of `counts` tokens, one per sequence (in one pass: a batch holds
    hundreds of responses)."""
    sequence = torch.repeat_interleave(torch.arange(len(counts)), counts)
    return tokens.new_zeros(len(counts)).index_add_(0, sequence, tokens)


def sequence_mismatch_metrics(trainer: torch.Tensor, engine: torch.Tensor, tokens_per_sequence: list[int]
                              ) -> dict[str, float]:
    """VeRL's off-policy diagnostics over whole responses: each policy's perplexity (the mean over
    responses of exp(-their mean log-prob)) and log-perplexity, the difference of the two
    log-perplexities (rollout's mean log-prob minus the trainer's: mean, mean size, max, min), the
    perplexity ratio (mean of exp of that difference), and the chi-square divergences E[r^2] - 1 of
    the tokens' ratios r = pi_trainer / pi_engine and of the responses' products of them."""
    counts = torch.tensor([n for n in tokens_per_sequence if n])
    trainer_mean, engine_mean = (_per_sequence_sums(x, counts) / counts for x in (trainer, engine))
    log_ratio = (trainer - engine).clamp(-SAFE_LOG_RATIO, SAFE_LOG_RATIO)
    sequence_log_ratio = _per_sequence_sums(trainer - engine, counts)
    log_ppl_diff = engine_mean - trainer_mean
    return {
        "mismatch/training_ppl": torch.exp(-trainer_mean).mean().item(),
        "mismatch/training_log_ppl": (-trainer_mean).mean().item(),
        "mismatch/rollout_ppl": torch.exp(-engine_mean).mean().item(),
        "mismatch/rollout_log_ppl": (-engine_mean).mean().item(),
        "mismatch/log_ppl_diff": log_ppl_diff.mean().item(),
        "mismatch/log_ppl_abs_diff": log_ppl_diff.abs().mean().item(),
        "mismatch/log_ppl_diff_max": log_ppl_diff.max().item(),
        "mismatch/log_ppl_diff_min": log_ppl_diff.min().item(),
        "mismatch/ppl_ratio": torch.exp(log_ppl_diff).mean().item(),
        "mismatch/chi2_token": (torch.exp(log_ratio).square().mean() - 1).item(),
        "mismatch/chi2_seq": (torch.exp(2 * sequence_log_ratio.clamp(-SAFE_LOG_RATIO, SAFE_LOG_RATIO)).mean()
                              - 1).item(),
    }
