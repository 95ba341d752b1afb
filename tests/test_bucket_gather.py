"""A bucket of FSDP-sharded tensors is gathered whole in one all-gather per mesh dimension, in the
engine's dtype (`rlsys.sync.bucket_gather`), equal bit for bit to each tensor's own
`full_tensor` cast after; other layouts go by `full_tensor`. Four gloo ranks, no Ray."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

pytestmark = [pytest.mark.quick, pytest.mark.xdist_group("fsdp_units")]

WORLD = 4


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"uneven": torch.randn(5, 3, generator=generator),  # rows 2, 2, 1, 0 by torch.chunk's split
            "even": torch.randn(8, 4, generator=generator),
            "bias": torch.randn(3, generator=generator),  # fewer rows than ranks
            "ids": torch.arange(6),  # an integer tensor keeps its dtype
            "columns": torch.randn(4, 8, generator=generator),  # a tensor-parallel split: by full_tensor
            "replica": torch.randn(2, 2, generator=generator),
            "hsdp": torch.randn(7, 2, generator=generator)}  # rows over the second of a 2 x 2 mesh


def _rank(rank: int, store: str, conn) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from rlsys.sync import bucket_gather

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    flat, square = init_device_mesh("cpu", (WORLD,)), init_device_mesh("cpu", (2, 2))
    whole = _tensors()
    placed = {name: distribute_tensor(tensor, flat, [Shard(0)]) for name, tensor in whole.items()}
    placed["columns"] = distribute_tensor(whole["columns"], flat, [Shard(1)])
    placed["replica"] = distribute_tensor(whole["replica"], flat, [Replicate()])
    placed["hsdp"] = distribute_tensor(whole["hsdp"], square, [Replicate(), Shard(0)])
    gathers = []
    all_gather = bucket_gather.dist.all_gather
    bucket_gather.dist.all_gather = lambda *args, **kwargs: gathers.append(1) or all_gather(*args, **kwargs)
    full = bucket_gather.gather_full(list(placed.values()), torch.bfloat16)
    expected = [tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor for tensor in whole.values()]
    conn.send({"equal": [bool(torch.equal(got, want)) and got.dtype == want.dtype for got, want in zip(full, expected)],
               "all_gathers": len(gathers)})
    dist.destroy_process_group()


def test_a_bucket_of_row_shards_is_gathered_in_one_collective_in_the_engines_dtype(tmp_path):
    context = multiprocessing.get_context("spawn")
    pipes = [context.Pipe(duplex=False) for _ in range(WORLD)]
    ranks = [context.Process(target=_rank, args=(rank, str(tmp_path / "store"), pipes[rank][1]))
             for rank in range(WORLD)]
    for process in ranks:
        process.start()
    results = [receiver.recv() if receiver.poll(120) else None for receiver, _ in pipes]
    for process in ranks:
        process.join(30)
    names = list(_tensors())
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} gave no result"
        assert dict(zip(names, result["equal"])) == dict.fromkeys(names, True), rank
        # one for the flat mesh's row shards (uneven, even, bias, ids), one for the 2 x 2 mesh's (hsdp)
        assert result["all_gathers"] == 2, rank
