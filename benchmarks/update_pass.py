"""The update's forward and backward over one RL batch, timed in one process: the passes that
`benchmarks/vs_trl.py`'s floor and `benchmarks/shared_prefix.py` compare."""

from __future__ import annotations

import statistics
import time


def packed_inputs(batch, share: bool, spans: bool | None = None, min_shared_fraction: float | None = None
                  ) -> tuple[dict, dict]:
    """`batch` packed (each group's prompt once if `share`, where it removes `min_shared_fraction`
    of the group's tokens: the training ranks' bar unless given), and its forward's inputs besides
    input_ids: a dense block-causal mask, or span attention (`spans`; None: where the training
    ranks take it, `SharedPrefixSpans.of`). The model needs `apply_span_attention` for spans."""
    from rlsys.data.packing import MIN_SHARED_FRACTION, block_causal_mask, pack_rows
    from rlsys.parallel.span_attention import MIN_PAIRS_SAVED_PER_TOKEN, SharedPrefixSpans, span_inputs

    fraction = MIN_SHARED_FRACTION if min_shared_fraction is None else min_shared_fraction
    packed = pack_rows(batch, share, fraction).batch
    segments, prefixes = packed["segment_ids"], packed["prefix_ids"]
    chosen = None
    if spans is not False and bool(prefixes.any()):
        chosen = SharedPrefixSpans.of(segments, prefixes, 0 if spans else MIN_PAIRS_SAVED_PER_TOKEN)
    attention = (span_inputs(chosen, *segments.shape) if chosen is not None
                 else {"attention_mask": block_causal_mask(segments, prefixes)})
    return packed, {"position_ids": packed["position_ids"], **attention}


def forward_backward_s(model, batch, repeats: int = 1, **inputs) -> float:
    """Median seconds of `repeats` forward and backward passes of a token-level loss (the sum of
    the log-probs of `batch`'s loss tokens) over `batch`'s input_ids, the forward also given
    `inputs` (masks, positions, spans)."""
    from rlsys.algorithms.lm_loss import logprobs_of_labels

    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        logits = model(input_ids=batch["input_ids"], use_cache=False, **inputs).logits
        (logprobs_of_labels(logits, batch["input_ids"]) * batch["loss_mask"][:, 1:]).sum().backward()
        times.append(time.perf_counter() - started)
        model.zero_grad(set_to_none=True)
    return statistics.median(times)
