"""The update's forward and backward over one RL batch, timed in one process: the passes that
`benchmarks/vs_trl.py`'s floor and `benchmarks/shared_prefix.py` compare."""

from __future__ import annotations

import statistics
import time

from random_model import ensure_random_model


def span_attention_model(path: str):
    """The causal LM at `path` in fp32, attending packed rows by spans as the training ranks do (the
    benchmarks' random 22.7 M model written first where it is missing)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlsys.parallel.span_attention import apply_span_attention

    if path.endswith("random22m-v103"):
        ensure_random_model(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    apply_span_attention(model)
    return model


def packed_inputs(batch, share: bool, spans: bool = True) -> tuple[dict, dict]:
    """`batch` packed (the contexts its rows share once, as a tree, if `share`), and its forward's inputs besides
    input_ids: attention by spans as the training ranks run it (the model needs
    `apply_span_attention`), or (`spans=False`) a dense block-causal mask over each row's width."""
    from rlsys.data.packing import block_causal_mask, pack_rows
    from rlsys.parallel.span_attention import SharedPrefixSpans, span_inputs

    packed = pack_rows(batch, share).batch
    segments, prefixes = packed["segment_ids"], packed["prefix_ids"]
    attention = (span_inputs(SharedPrefixSpans.of(segments, prefixes), *segments.shape) if spans
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
