"""A colocated engine gives its memory to the trainer between rollouts.

After generating, the engine's weights and KV cache are dead weight: the
trainer's update is next, and the sync after it rewrites every weight. Like
VeRL, a colocated engine frees both after generating (on CPU the weights
alone, see below), takes its weights back just before the sync and its KV
cache just before generating again.

On GPU this is vLLM's sleep mode at level 2. vLLM has no sleep mode on CPU:
there the storages of the weights shrink to nothing and grow back, which keeps
every tensor valid and loses only the contents. The KV cache stays on CPU:
grown back, every page of it that vLLM writes faults anew, and vLLM's block
allocator walks the whole cache over the steps, which costs more generate time
than the memory is worth there.

A weight the sync does not rewrite would generate with garbage, so the engine
counts what each load wrote and refuses to generate until the sync has
rewritten every weight it freed. The count is by vLLM parameter: a fused one
(qkv_proj) counts as written once any of its parts is.
"""

from __future__ import annotations

import torch

from rlsys.host_memory import TRIM_ABOVE_BYTES, release_freed_memory
from rlsys.rollout.vllm_compat import loaded_parameters

WEIGHTS, KV_CACHE = "weights", "kv_cache"


class EngineMemory:
    def __init__(self, llm, on_gpu: bool):
        self.llm, self.on_gpu = llm, on_gpu
        self.freed_tags = (WEIGHTS, KV_CACHE) if on_gpu else (WEIGHTS,)
        self.released: set[str] = set()
        self.awaiting_rewrite = False

    def release(self) -> int:
        """Free whatever of `freed_tags` is still held (an engine that got no prompts this step
        still holds its weights, not its KV cache); the bytes freed (on GPU: the device's free
        memory gained)."""
        held = [tag for tag in self.freed_tags if tag not in self.released]
        if not held:
            return 0
        if self.on_gpu:
            if self.released:  # vLLM puts only a fully awake engine to sleep
                self.llm.wake_up(tags=sorted(self.released))
            free_before = sum(self.llm.collective_rpc(_free_device_bytes))
            self.llm.sleep(level=2)
            freed = sum(self.llm.collective_rpc(_free_device_bytes)) - free_before
        else:
            freed = sum(self.llm.collective_rpc(_shrink_storages, args=(held,)))
        self.released = set(self.freed_tags)
        return freed

    def resume(self, tag: str) -> None:
        """Allocate the weights (contents undefined until the sync writes them) or the KV cache."""
        if tag not in self.released:
            return
        if self.on_gpu:
            self.llm.wake_up(tags=[tag])
        else:
            self.llm.collective_rpc(_regrow_storages, args=(tag,))
        if tag == WEIGHTS:
            self.llm.collective_rpc(_expect_rewrite)
            self.awaiting_rewrite = True
        else:
            self.llm.reset_prefix_cache()
        self.released.discard(tag)

    def confirm_rewritten(self) -> None:
        """After a sync: every weight resumed for it must have been written."""
        if not self.awaiting_rewrite:
            return
        unwritten = sorted(set().union(*self.llm.collective_rpc(_unwritten_weights)))
        if unwritten:
            raise RuntimeError(f"rollout engine: the sync did not rewrite {len(unwritten)} freed weights, "
                               f"e.g. {unwritten[:3]}")
        self.awaiting_rewrite = False

    def ready_to_generate(self) -> None:
        if WEIGHTS in self.released or self.awaiting_rewrite:
            raise RuntimeError("rollout engine: generate called before a sync rewrote its released weights")
        self.resume(KV_CACHE)


# -- run inside each vLLM worker (collective_rpc) -------------------------------


def record_loaded(worker, names: set[str] | None) -> None:
    """Called with the names each `load_weights` reports writing (None: a model that does not
    report them, which cannot be checked)."""
    pending = getattr(worker, "rlsys_unwritten", None)
    if pending:
        pending.difference_update(loaded_parameters(names) if names is not None else pending.copy())


def _storages(worker, tag: str) -> dict[int, torch.UntypedStorage]:
    if tag == WEIGHTS:
        tensors = [p for _, p in worker.model_runner.get_model().named_parameters()]
    else:
        tensors = list(worker.model_runner.kv_caches)
    return {t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors}


def _free_device_bytes(worker) -> int:
    """Free memory of the GPU a vLLM worker runs on, read there: an engine of tensor-parallel workers in
    other actors' bundles holds no GPU of its own, and reading one from its actor would open a CUDA
    context on the node's first GPU."""
    return torch.cuda.mem_get_info()[0]


def _shrink_storages(worker, tags: list[str]) -> int:
    released = getattr(worker, "rlsys_released", {})
    freed = 0
    for tag in tags:
        released[tag] = [(storage, storage.nbytes()) for storage in _storages(worker, tag).values()]
        for storage, nbytes in released[tag]:
            storage.resize_(0)
            freed += nbytes
    worker.rlsys_released = released
    release_freed_memory(TRIM_ABOVE_BYTES)
    return freed


def _regrow_storages(worker, tag: str) -> None:
    for storage, nbytes in worker.rlsys_released.pop(tag):
        storage.resize_(nbytes)


def _expect_rewrite(worker) -> None:
    worker.rlsys_unwritten = {name for name, _ in worker.model_runner.get_model().named_parameters()}


def _unwritten_weights(worker) -> set[str]:
    return set(getattr(worker, "rlsys_unwritten", ()))
