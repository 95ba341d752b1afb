"""A model directory's safetensors files, read region by region straight into a rank's tensors.

A safetensors file is a JSON header (each tensor's dtype, shape and byte range) followed by the
tensors' bytes, row-major. A rank reads only the bytes of the region it holds, with `pread` into
its own tensor's memory when the region is contiguous on disk and the dtypes agree, else through
a buffer of at most `BUFFER_BYTES`. Nothing is memory-mapped, so the files' pages never count in
the rank's resident memory, and no second copy of a tensor is made.
"""

from __future__ import annotations

import json
import math
import os
import struct
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

BUFFER_BYTES = 64 * 2**20
"""The most a read of a region that is not contiguous on disk (or needs a dtype change) holds."""

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


@dataclass(frozen=True)
class StoredTensor:
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    """Byte offset of the tensor's first element in `file`."""


def stored_tensors(path: str) -> dict[str, StoredTensor]:
    """Every tensor of the model directory `path`, by name: the files its
    `model.safetensors.index.json` names, else its `model.safetensors`."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    found = {}
    for file in files:
        found.update(_header(os.path.join(path, file)))
    return found


def _header(file: str) -> dict[str, StoredTensor]:
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return {name: StoredTensor(file, DTYPES[entry["dtype"]], tuple(entry["shape"]), 8 + size + entry["data_offsets"][0])
            for name, entry in header.items()}


class TensorReader(AbstractContextManager):
    """Reads regions of stored tensors into tensors, holding each file open once."""

    def __init__(self, tensors: dict[str, StoredTensor]):
        self.tensors = tensors
        self._files: dict[str, int] = {}

    def __exit__(self, *exc) -> None:
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()

    def read_into(self, name: str, region: tuple[slice, ...], out: torch.Tensor) -> None:
        """Copy the region (one slice per leading dimension; the rest whole) of the stored tensor
        `name` into `out`, converting its dtype to `out`'s."""
        stored = self.tensors[name]
        region = _full_region(region, stored.shape)
        if tuple(s.stop - s.start for s in region) != tuple(out.shape):
            raise ValueError(f"{name}: region {region} of {stored.shape} does not fit {tuple(out.shape)}")
        if not out.numel():
            return
        if _contiguous_on_disk(region, stored.shape) and out.is_contiguous() and out.device.type == "cpu" \
                and out.dtype == stored.dtype:
            self._pread(stored, _offset(region, stored.shape) * stored.dtype.itemsize, _bytes_of(out))
        elif not stored.shape:
            scalar = torch.empty((), dtype=stored.dtype)
            self._pread(stored, 0, _bytes_of(scalar))
            out.copy_(scalar)
        else:
            self._read_in_blocks(stored, region, out)

    def read(self, name: str, region: tuple[slice, ...]) -> torch.Tensor:
        """The region of the stored tensor `name` as a new tensor of its stored dtype."""
        stored = self.tensors[name]
        full = _full_region(region, stored.shape)
        out = torch.empty(tuple(s.stop - s.start for s in full), dtype=stored.dtype)
        self.read_into(name, region, out)
        return out

    def _read_in_blocks(self, stored: StoredTensor, region: tuple[slice, ...], out: torch.Tensor) -> None:
        """The region's rows (dimension 0) whole, a block of them at a time, each sliced to the
        region's other dimensions and copied (converting) into `out`."""
        row_shape = stored.shape[1:]
        row_bytes = math.prod(row_shape) * stored.dtype.itemsize
        per_block = max(1, BUFFER_BYTES // max(row_bytes, 1))
        rows = region[0]
        for first in range(rows.start, rows.stop, per_block):
            last = min(rows.stop, first + per_block)
            block = torch.empty((last - first, *row_shape), dtype=stored.dtype)
            self._pread(stored, first * row_bytes, _bytes_of(block))
            out[first - rows.start:last - rows.start].copy_(block[(slice(None), *region[1:])])

    def _pread(self, stored: StoredTensor, offset: int, into: memoryview) -> None:
        fd = self._files.get(stored.file)
        if fd is None:
            fd = self._files[stored.file] = os.open(stored.file, os.O_RDONLY)
        position, done = stored.start + offset, 0
        while done < len(into):
            got = os.preadv(fd, [into[done:]], position + done)
            if got <= 0:
                raise OSError(f"{stored.file}: ended {len(into) - done} bytes before the tensor's end")
            done += got


def _full_region(region: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    """One slice with explicit bounds per dimension (trailing dimensions whole)."""
    given = [slice(*s.indices(n)[:2]) for s, n in zip(region, shape)]
    return tuple(given + [slice(0, n) for n in shape[len(given):]])


def _contiguous_on_disk(region: tuple[slice, ...], shape: tuple[int, ...]) -> bool:
    """Whether the region's bytes are one range: after its first partial dimension, every dimension
    is whole, and before it every dimension takes one index."""
    partial = [i for i, (s, n) in enumerate(zip(region, shape)) if (s.start, s.stop) != (0, n)]
    if not partial:
        return True
    first = partial[0]
    return all(region[i].stop - region[i].start == 1 for i in range(first)) and partial == [first]


def _offset(region: tuple[slice, ...], shape: tuple[int, ...]) -> int:
    """Elements stored before the region's first element."""
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    return sum(s.start * stride for s, stride in zip(region, strides))


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's memory, writable, as bytes."""
    return memoryview(tensor.view(-1).view(torch.uint8).numpy()).cast("B")
