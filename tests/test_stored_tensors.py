"""The streaming loader's reads: every region of a stored tensor (row blocks, column slices,
single elements, scalars), in its dtype or converted, into contiguous and strided tensors, equals
the same slice of the tensor that was saved; a region that does not fit its target is refused."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from safetensors.torch import save_file

from rlsys.trainer import stored_tensors
from rlsys.trainer.stored_tensors import TensorReader

pytestmark = pytest.mark.quick  # the quick tier (scripts/test.sh --quick)


@pytest.fixture
def saved(tmp_path) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    first = {"matrix": torch.randn(7, 5, generator=g), "cube": torch.randn(3, 4, 6, generator=g).to(torch.bfloat16),
             "scalar": torch.tensor(3.5), "vector": torch.randn(11, generator=g)}
    second = {"ints": torch.arange(24, dtype=torch.int64).view(4, 6)}
    files = {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": second}
    for file, tensors in files.items():
        save_file(tensors, str(tmp_path / file))
    weight_map = {name: file for file, tensors in files.items() for name in tensors}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return {**first, **second}


def regions(shape: tuple[int, ...]):
    spans = [[slice(a, b) for a in range(n) for b in range(a + 1, n + 1)] for n in shape]
    return itertools.product(*spans)


def test_every_region_reads_as_the_saved_slice(saved, tmp_path, monkeypatch):
    monkeypatch.setattr(stored_tensors, "BUFFER_BYTES", 40)  # blocks of a row or two: every block boundary
    found = stored_tensors.stored_tensors(str(tmp_path))
    assert {name: (entry.dtype, entry.shape) for name, entry in found.items()} == \
        {name: (t.dtype, tuple(t.shape)) for name, t in saved.items()}
    with TensorReader(found) as reader:
        for name, tensor in saved.items():
            for region in regions(tuple(tensor.shape)):
                want = tensor[region]
                for dtype in {tensor.dtype, torch.float32, torch.float64}:
                    out = torch.full(want.shape, -7, dtype=dtype)
                    reader.read_into(name, region, out)
                    assert torch.equal(out, want.to(dtype)), (name, region, dtype)
                if want.dim() == 2:  # a strided target (a transposed view)
                    out = torch.zeros(want.shape[1], want.shape[0], dtype=tensor.dtype).t()
                    reader.read_into(name, region, out)
                    assert torch.equal(out, want), (name, region)
            assert torch.equal(reader.read(name, ()), tensor)


def test_a_region_that_does_not_fit_its_target_is_refused(saved, tmp_path):
    with TensorReader(stored_tensors.stored_tensors(str(tmp_path))) as reader:
        with pytest.raises(ValueError, match="does not fit"):
            reader.read_into("matrix", (slice(0, 3),), torch.empty(2, 5))
