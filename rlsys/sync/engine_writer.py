"""Writing synced weights into a vLLM engine's parameters, in each vLLM worker.

vLLM's `load_weights` maps each HF-named full tensor onto the engine's
parameters: it fuses q/k/v and gate/up and slices for the engine's
tensor-parallel rank. Going through it on every sync costs a full tensor per
weight (the training ranks' shards assembled in a staging buffer, which the
loader then copies again) and the loader's Python work per tensor, several
times the cost of the copies it makes.

So the first time a weight arrives, vLLM's loader places it and every copy it
makes from the weight into a parameter is recorded: the parameter's view
written, and the view of the weight read (`_Recording`). The record is checked
at once: the parameters written are overwritten with NaN, the recorded copies
replayed, and the parameters must come out equal to what the loader wrote. A
weight whose copies pass is replayed from then on; one that fails (a parameter
written some other way, or only in part, as vLLM pads a vocabulary) keeps
going through the loader. A weight copied whole into one place (no fusing, no
slicing) takes each training rank's shard straight to its place in the
parameter, with no full tensor in between.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlsys.sync.shards import Assembler, Pieces


@dataclass(frozen=True)
class _Copy:
    """One copy vLLM's loader made from a weight into a parameter."""

    param: str
    target: torch.Tensor
    """The view of the parameter written (it stays valid as the parameter's storage shrinks and grows)."""
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    """The view of the full weight read, `size` and `stride` from `offset` elements into it."""

    def source(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.as_strided(self.size, self.stride, weight.storage_offset() + self.offset)

    def reads_whole(self, weight: torch.Tensor) -> bool:
        return self.size == tuple(weight.shape) and self.offset == 0 and self.stride == weight.stride()


class EngineWeightWriter:
    def __init__(self, model: torch.nn.Module, loader_names: Callable[[str, torch.Tensor], list] | None = None):
        """`loader_names(name, weight)`: the (name, view of the weight) pairs vLLM's loader reads
        for one trainer weight, where its names differ (an MoE's fused experts, which the loader
        reads one expert at a time, under the checkpoint's names); None: the weight as named."""
        self.model = model
        self.loader_names = loader_names
        self.params = dict(model.named_parameters())
        self.copies: dict[str, list[_Copy]] = {}
        """The recorded copies of each weight that replays exactly."""
        self.takes_shards: set[str] = set()
        """Weights copied whole into one place: their shards go straight there."""
        self.through_loader: set[str] = set()
        """Weights whose recorded copies did not reproduce the loader's result."""
        self.assemble = Assembler()

    def __call__(self, pieces: Pieces) -> set[str] | None:
        """Write one bucket's weights; returns the names of the parameters written (None when
        the model's loader does not report them)."""
        written: set[str] = set()
        for name in pieces.keys() & self.takes_shards:
            [copy] = self.copies[name]
            for entry, shard in pieces[name]:
                copy.target[entry.region].copy_(shard)
            written.add(copy.param)
        full = self.assemble({name: parts for name, parts in pieces.items() if name not in self.takes_shards})
        for name in full.keys() & self.copies.keys():
            for copy in self.copies[name]:
                copy.target.copy_(copy.source(full[name]))
                written.add(copy.param)
        loaded = self._load({name: full[name] for name in full.keys() & self.through_loader})
        recorded = self._load_and_record({name: weight for name, weight in full.items()
                                          if name not in self.copies and name not in self.through_loader})
        return None if loaded is None or recorded is None else written | loaded | recorded

    def release(self) -> None:
        self.assemble.release()

    def _load(self, weights: dict[str, torch.Tensor]) -> set[str] | None:
        """vLLM's loader on `weights`. Views of a traced weight stay traced, so the copies the loader
        makes from the views `loader_names` gives are recorded as copies from the weight."""
        if not weights:
            return set()
        if self.loader_names is not None:
            weights = dict(pair for name, weight in weights.items() for pair in self.loader_names(name, weight))
        return self.model.load_weights(weights=iter(weights.items()))

    def _load_and_record(self, weights: dict[str, torch.Tensor]) -> set[str] | None:
        """The first time: vLLM's loader places the weights, and its copies are recorded."""
        if not weights:
            return set()
        owners = {param.untyped_storage().data_ptr(): name for name, param in self.params.items()}
        recording = _Recording(weights, owners)
        loaded = self._load(recording.traced())
        replayable = self._replays_exactly(recording)
        for name, weight in weights.items():
            if name not in replayable:
                self.through_loader.add(name)
                continue
            self.copies[name] = recording.copies[name]
            if len(self.copies[name]) == 1 and self.copies[name][0].reads_whole(weight):
                self.takes_shards.add(name)
        return loaded

    @torch.no_grad()
    def _replays_exactly(self, recording: _Recording) -> set[str]:
        """The weights whose recorded copies, replayed over NaN, rewrite every parameter they
        touch exactly as the loader did. The parameters are left as the loader wrote them."""
        copies = {name: recorded for name, recorded in recording.copies.items() if name not in recording.unrecordable}
        touched = {copy.param for recorded in recording.copies.values() for copy in recorded
                   if self.params[copy.param].is_floating_point()}  # NaN marks what the replay missed
        loaded = {param: self.params[param].detach().clone() for param in touched}
        for param in touched:
            self.params[param].data.fill_(float("nan"))
        for name, recorded in copies.items():
            for copy in recorded:
                copy.target.copy_(copy.source(recording.weights[name]))
        exact = {param for param in touched if torch.equal(self.params[param], loaded[param])}
        for param in touched:
            self.params[param].data.copy_(loaded[param])
        return {name for name, recorded in copies.items() if all(copy.param in exact for copy in recorded)}


class _Recording:
    """The copies vLLM's loader makes from `weights` into parameters."""

    def __init__(self, weights: dict[str, torch.Tensor], storage_owner: dict[int, str]):
        self.weights = weights
        self.storage_owner = storage_owner
        """Parameter name by its storage's address."""
        self.copies: dict[str, list[_Copy]] = {}
        self.unrecordable: set[str] = set()
        """Weights copied from something that is not a view of them, or into something that is
        not a parameter."""

    def traced(self) -> dict[str, _Traced]:
        traced = {}
        for name, weight in self.weights.items():
            traced[name] = weight.as_subclass(_Traced)
            traced[name].origin = (self, name)
        return traced

    def note_copy(self, target: torch.Tensor, source: torch.Tensor, name: str) -> None:
        weight = self.weights[name]
        param = self.storage_owner.get(target.untyped_storage().data_ptr())
        if param is None or source.dtype != weight.dtype or not _views(source, weight):
            self.unrecordable.add(name)
            return
        offset = (source.data_ptr() - weight.data_ptr()) // weight.element_size()
        self.copies.setdefault(name, []).append(_Copy(param, target, tuple(source.shape), source.stride(), offset))


class _Traced(torch.Tensor):
    """A weight handed to vLLM's loader: views of it stay traced, and a `copy_` from one is
    noted by the recording it came from."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_ and hasattr(args[1], "origin"):
            recording, name = args[1].origin
            with torch._C.DisableTorchFunctionSubclass():
                recording.note_copy(args[0], args[1], name)
        origin = next((arg.origin for arg in args if hasattr(arg, "origin")), None)
        result = super().__torch_function__(func, types, args, kwargs or {})
        for tensor in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(tensor, _Traced) and origin is not None:
                tensor.origin = origin
        return result


def _views(view: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether every element of `view` lies within `base`'s bytes (base contiguous)."""
    start = view.data_ptr() - base.data_ptr()
    extent = sum((size - 1) * stride for size, stride in zip(view.shape, view.stride())) + 1
    return (start >= 0 and start % base.element_size() == 0
            and start // base.element_size() + extent <= base.numel() and view.numel() > 0)
