"""The output layer's precision. With bf16 compute the logits are rounded to bf16 (8 bits of
mantissa: 0.03 at a logit of 10), each side of an RL step rounding its own; computing them in
fp32 from the same bf16 hidden states and weights removes that rounding from the trainer/engine
log-prob gap. The engine does the same through vLLM's `head_dtype` (`create_llm`)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn


def compute_logits_in_fp32(lm_head: nn.Linear) -> None:
    """`lm_head` returns fp32 logits: its bf16 input and weight are cast up (exactly) before the
    matmul, which then multiplies and sums in fp32. Its weight is read at each call, so FSDP's
    unsharded (and mixed-precision cast) parameter and a tied embedding are what it multiplies."""

    def forward(hidden):
        bias = None if lm_head.bias is None else lm_head.bias.float()
        return F.linear(hidden.float(), lm_head.weight.float(), bias)

    lm_head.forward = forward
