"""The exported directory's weight files as the Hub's tools expect them: shards of at most the size
limit, numbered over the pipeline stages in order, an index naming each tensor's shard and the total
size, floating-point tensors in the export dtype (others as they are), files readable as the umask
says. (Whole exports, read back by transformers and vLLM, are test_train_resume_export's.)"""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
from safetensors.torch import load_file

from rlsys.trainer.hf_export import StageShards, name_shards

pytestmark = pytest.mark.quick


def test_stages_write_numbered_shards_of_at_most_the_limit_and_an_index(tmp_path):
    old_umask = os.umask(0o027)
    try:
        tensors = {0: {"a": torch.randn(100), "b": torch.randn(100), "c": torch.arange(100)},
                   1: {"d": torch.randn(300)}}
        for stage, named in tensors.items():
            shards = StageShards(str(tmp_path), stage, torch.bfloat16, max_bytes=500)
            for name, tensor in named.items():
                shards.add(name, tensor)
            shards.close()
        name_shards(str(tmp_path))
    finally:
        os.umask(old_umask)
    files = sorted(os.listdir(tmp_path))
    assert files == ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                     "model-00003-of-00003.safetensors", "model.safetensors.index.json"]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {"a": files[0], "b": files[0], "c": files[1], "d": files[2]}
    assert index["metadata"]["total_size"] == 2 * 100 * 2 + 100 * 8 + 300 * 2  # bf16 floats, the int64 as it is
    loaded = {k: v for f in files[:3] for k, v in load_file(tmp_path / f).items()}
    assert loaded["a"].dtype == torch.bfloat16 and torch.equal(loaded["a"], tensors[0]["a"].to(torch.bfloat16))
    assert loaded["c"].dtype == torch.int64 and torch.equal(loaded["c"], tensors[0]["c"])
    for name in files[:3]:
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o640  # 0666 under the umask 027


def test_one_shard_is_model_safetensors_without_an_index(tmp_path):
    shards = StageShards(str(tmp_path), 0, torch.float32)
    shards.add("w", torch.randn(4, 4))
    shards.close()
    name_shards(str(tmp_path))
    assert os.listdir(tmp_path) == ["model.safetensors"]
