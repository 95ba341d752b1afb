"""Tensor parallelism for Hugging Face decoder models (Llama, Qwen2, Qwen3, Mistral, and the
MoE families Qwen2-MoE, Qwen3-MoE, Mixtral, whose MoE blocks `expert_parallel` lays out).

Megatron's pairing inside every block: q/k/v and gate/up are split by output
columns, o and down by input rows, so each attention and each MLP needs one
all-reduce. The embedding is split by vocabulary rows, the LM head by
vocabulary columns, unevenly where tp does not divide the vocabulary (DTensor's
uneven shards: the first ranks hold one row more), so checkpoints, exports and
the weight sync see the model's own shapes. Both split their [vocab, hidden]
weight by rows (Shard(0)), so an LM head tied to the embedding (SmolLM2, Qwen2.5's
small models) stays one parameter: its gradient sums the two uses, as in one process.
HF attention reshapes with `view(..., -1, head_dim)`, so each rank runs its own heads
without patching the model.

Sequence parallel (optional) keeps the norms and the residual stream split
along the sequence between the tensor-parallel ranks: the all-reduces become
a reduce-scatter plus an all-gather, and activations outside attention and
MLP take 1/tp of the memory. Loss parallel (optional) leaves the logits split
by vocabulary; the log-softmax then runs on the shards
(`rlsys.algorithms.lm_loss.logprobs_of_labels`).
"""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from transformers import PretrainedConfig

from rlsys.parallel.dims import LayoutError

log = logging.getLogger(__name__)

TP_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "qwen2_moe", "qwen3_moe", "mixtral", "qwen2_vl_text",
               "qwen2_5_vl_text", "qwen3_vl_text")
"""Model types (a vision-language model's: its language model's) whose module names and attention
follow the plan below. A vision-language model's vision tower is not split: every tensor-parallel
rank holds it whole (FSDP2 shards it over the data-parallel ranks) and runs it on the same pictures."""


def check_tp_family(model_config: PretrainedConfig) -> None:
    model_type = model_config.get_text_config().model_type
    if model_type not in TP_FAMILIES:
        raise LayoutError(f"parallel.tp: no tensor-parallel plan for model type {model_type!r} "
                          f"(plans: {', '.join(TP_FAMILIES)})")


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool, loss_parallel: bool,
             value_head: bool = False) -> None:
    """Turn `model`'s weights into DTensors over `tp_mesh`, in place; parameter names stay HF's.
    A critic's one-output value head is not split: it takes the whole sequence."""
    residual = Shard(1) if sequence_parallel else Replicate()
    decoder = "model.language_model" if _has_module(model, "model.language_model") else "model"
    top = top_plan(residual, sequence_parallel, loss_parallel, value_head, decoder)
    # a pipeline stage lacks the embedding, the final norm or the LM head, and most blocks
    present = {name: style for name, style in top.items() if _has_module(model, name)}
    tied = _tied_lm_head(model, decoder)
    parallelize_module(model, tp_mesh, present)
    if tied:  # parallelize_module gave each module a DTensor of its own: the same rows, tied again
        model.lm_head.weight = model.get_submodule(f"{decoder}.embed_tokens").weight
    for block in model.get_submodule(decoder).layers:
        if block is not None:
            parallelize_module(block, tp_mesh, block_plan(block, residual, sequence_parallel))
    log.info("tensor parallel over %d ranks (sequence parallel %s, loss parallel %s)", tp_mesh.size(),
             "on" if sequence_parallel else "off", "on" if loss_parallel else "off")


def top_plan(residual, sequence_parallel: bool, loss_parallel: bool, value_head: bool, decoder: str = "model"
             ) -> dict:
    """The styles of the modules outside the decoder blocks, by module name; `decoder`: the module
    holding the embedding, blocks and final norm (a vision-language model's language model)."""
    top = {
        f"{decoder}.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        "lm_head": ColwiseParallel(input_layouts=residual,
                                   output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                   use_local_output=not loss_parallel),
    }
    if value_head:
        top["lm_head"] = PrepareModuleInput(input_layouts=(residual,), desired_input_layouts=(Replicate(),),
                                            use_local_output=True)
    if sequence_parallel:
        top[f"{decoder}.norm"] = SequenceParallel()
    return top


def _tied_lm_head(model: nn.Module, decoder: str) -> bool:
    return (_has_module(model, "lm_head") and _has_module(model, f"{decoder}.embed_tokens")
            and model.lm_head.weight is model.get_submodule(f"{decoder}.embed_tokens").weight)


def _has_module(model: nn.Module, name: str) -> bool:
    try:
        return model.get_submodule(name) is not None
    except AttributeError:
        return False


def block_plan(block: nn.Module, residual, sequence_parallel: bool) -> dict:
    """A dense MLP is split Megatron's way; an MoE block (`expert_parallel.apply_moe_tp`) is not."""
    dense_mlp = not hasattr(block.mlp, "experts")
    plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=residual),
    }
    if dense_mlp:
        plan.update({
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=residual),
        })
    if hasattr(block.self_attn, "q_norm"):
        # Qwen3 normalises each head: weights replicated, input split on the heads dim of [B, T, H, D]
        plan["self_attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["self_attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if sequence_parallel:
        plan.update({
            "input_layernorm": SequenceParallel(),
            # HF passes hidden_states to attention by keyword, to the MLP positionally
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            "post_attention_layernorm": SequenceParallel(),
        })
        if dense_mlp:
            plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan
