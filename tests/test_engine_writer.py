"""The engine side of the sync: vLLM's loader places each weight the first time, its copies
are recorded and checked, and later syncs replay them (shards straight into place where the
loader copied a weight whole); shards in a training rank's shared memory are read in place."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from rlsys.sync.engine_writer import EngineWeightWriter
from rlsys.sync.gathered import GatherBuffers, capacity, open_own_buffers
from rlsys.sync.shards import pack, shard_pieces, share, shared_pieces

pytestmark = pytest.mark.quick  # the quick tier (scripts/test.sh --quick)


class FusingModel(torch.nn.Module):
    """Loads like a vLLM model: q and k fused into one parameter, one weight split in two
    (as a tensor-parallel rank takes its slice), a vocabulary padded with zeros (written by
    `fill_`, not copied), a norm copied after a conversion, a head whole."""

    def __init__(self):
        super().__init__()
        self.qk = torch.nn.Parameter(torch.zeros(6, 4))
        self.embed = torch.nn.Parameter(torch.zeros(8, 4))
        self.norm = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
        self.head = torch.nn.Parameter(torch.zeros(5, 4))
        self.left, self.right = torch.nn.Parameter(torch.zeros(4, 2)), torch.nn.Parameter(torch.zeros(4, 2))
        self.loader_calls: list[str] = []

    def load_weights(self, weights) -> set[str]:
        written = set()
        for name, weight in weights:
            self.loader_calls.append(name)
            if name in ("q", "k"):
                rows = slice(0, 4) if name == "q" else slice(4, 6)
                self.qk.data[rows].copy_(weight)
                written.add("qk")
            elif name == "embed":
                self.embed.data[:weight.shape[0]].copy_(weight)
                self.embed.data[weight.shape[0]:].fill_(0)
                written.add("embed")
            elif name == "norm":
                self.norm.data.copy_(weight.to(torch.float64))
                written.add("norm")
            elif name == "head":
                self.head.data.copy_(weight)
                written.add("head")
            elif name == "split":
                self.left.data.copy_(weight.narrow(1, 0, 2))
                self.right.data.copy_(weight.narrow(1, 2, 2))
                written.update(("left", "right"))
        return written


def weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = {"q": (4, 4), "k": (2, 4), "embed": (7, 4), "norm": (4,), "head": (5, 4), "split": (4, 4)}
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def two_rank_buckets(full: dict[str, torch.Tensor]) -> list:
    """Rank 0 holds the first rows of every weight, rank 1 the rest (the norm whole on rank 0)."""
    ranks = [[], []]
    for name, tensor in full.items():
        if tensor.dim() == 1:
            ranks[0].append((name, tensor, tuple(tensor.shape), (0,)))
            continue
        half = tensor.shape[0] // 2
        ranks[0].append((name, tensor[:half], tuple(tensor.shape), (0, 0)))
        ranks[1].append((name, tensor[half:], tuple(tensor.shape), (half, 0)))
    return [pack(shards) for shards in ranks]


def loader_result(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    model = FusingModel()
    model.load_weights(full.items())
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_replayed_syncs_write_what_the_loader_writes():
    model = FusingModel()
    place = EngineWeightWriter(model)
    for sync in range(3):
        full = weights(sync)
        model.loader_calls.clear()
        for param in model.parameters():  # the engine frees its weights between syncs
            param.data.fill_(float("nan"))
        written = place(shard_pieces(two_rank_buckets(full)))
        assert written == {"qk", "embed", "norm", "head", "left", "right"}
        expected = loader_result(full)
        for name, param in model.named_parameters():
            assert torch.equal(param, expected[name]), (sync, name)
        if sync == 0:
            assert sorted(model.loader_calls) == sorted(full)
        else:  # only what a replay cannot reproduce still goes through the loader
            assert sorted(model.loader_calls) == ["embed", "norm"]
    assert sorted(place.copies) == ["head", "k", "q", "split"]
    assert place.takes_shards == {"head", "k", "q"}  # "split" is read in slices: from a full tensor


def _trainer_side(conn, device: str) -> None:
    """A training rank's part: a shard that is a view into a padded buffer (as FSDP2 keeps an
    uneven shard), shared (moved into shared memory on CPU), then stepped in place on request."""
    padded = torch.arange(12, dtype=torch.float32, device=device)
    shard = padded[2:10].view(2, 4)
    conn.send(share([("w", shard, (4, 4), (2, 0))]))
    while conn.recv():
        padded.add_(1.0)  # the optimizer's step, on the buffer the shard views
        conn.send(shard.cpu())
    conn.send(None)  # CUDA IPC: the producer outlives the engine's mapping


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA IPC needs a GPU (scripts/gpu_check.sh runs this)"))])
def test_shared_shards_are_read_in_place_by_another_process(device):
    """The engine's side of an in-place sync: through the handles of a shard in another process's
    memory (shared memory on CPU, CUDA IPC on a GPU), it reads the shard's current values (after
    each in-place update there), where the shard lies in the full tensor, and nothing of the
    buffer around it."""
    context = multiprocessing.get_context("spawn")
    conn, child_conn = context.Pipe()
    trainer = context.Process(target=_trainer_side, args=(child_conn, device), daemon=True)
    trainer.start()
    try:
        pieces = shared_pieces([conn.recv()])
        [(entry, mapped)] = pieces["w"]
        assert entry.region == (slice(2, 4), slice(0, 4))
        assert mapped.device.type == device
        assert torch.equal(mapped.cpu(), torch.arange(2, 10, dtype=torch.float32).view(2, 4))
        for _ in range(2):
            conn.send(True)
            stepped = conn.recv()
            assert torch.equal(mapped.cpu(), stepped)
        del pieces, mapped
        conn.send(False)
        conn.recv()
    finally:
        trainer.join(timeout=30)


BUCKETS = {"a": (3, 5), "b": (7,)}, {"c": (2, 2)}
"""Two buckets' tensors (name: shape)."""


def _gathered(bucket: int, seed: int) -> list[tuple[str, torch.Tensor]]:
    return [(name, torch.randn(shape, generator=torch.Generator().manual_seed(seed + i)))
            for i, (name, shape) in enumerate(BUCKETS[bucket].items())]


def _gathering_rank(conn, device: str) -> None:
    """A training rank's part of a gathered sync: staging buffers sized for the larger bucket in
    bf16, shared, then each bucket asked for (fp32 full tensors) written into the slot asked for."""
    params = {name: torch.zeros(shape) for bucket in BUCKETS for name, shape in bucket.items()}
    buffers = GatherBuffers(capacity([list(bucket) for bucket in BUCKETS], params, torch.bfloat16),
                            torch.device(device))
    conn.send(buffers.share())
    while (request := conn.recv()) is not None:
        slot, bucket, seed = request
        tensors = [(name, tensor.to(device)) for name, tensor in _gathered(bucket, seed)]
        conn.send(buffers.write(slot, tensors, torch.bfloat16))
    conn.send(None)  # CUDA IPC: the producer outlives the engine's mapping


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA IPC needs a GPU (scripts/gpu_check.sh runs this)"))])
def test_a_gathered_bucket_is_read_in_place_by_the_engine_beside_its_rank(device):
    """The engine's side of a gathered sync: it maps the rank's two staging buffers once and reads
    each bucket, cast to the engine's dtype, from the slot the rank wrote it into, while the other
    slot keeps the bucket before."""
    context = multiprocessing.get_context("spawn")
    conn, child_conn = context.Pipe()
    rank = context.Process(target=_gathering_rank, args=(child_conn, device), daemon=True)
    rank.start()
    child_conn.close()  # the rank's end: its exit ends a wait here
    try:
        handles = conn.recv()
        assert len(handles) == 2
        buffers = open_own_buffers([handles])
        assert buffers[0].numel() == 64 + 64  # a (15 bf16) and b (7 bf16), each aligned to 64 bytes
        read = {}
        for slot, bucket, seed in ((0, 0, 1), (1, 1, 2), (0, 1, 3)):
            conn.send((slot, bucket, seed))
            entries = conn.recv()
            read[slot] = {entry.name: entry.view(buffers[slot]).clone() for entry in entries}
            expected = {name: tensor.to(torch.bfloat16) for name, tensor in _gathered(bucket, seed)}
            assert [entry.name for entry in entries] == list(expected)
            assert all(entry.dtype == torch.bfloat16 for entry in entries)
            assert all(torch.equal(read[slot][name].cpu(), tensor) for name, tensor in expected.items())
        slot_1 = {entry.name: entry.view(buffers[1]).cpu() for entry in entries}  # the same places in slot 1
        assert torch.equal(slot_1["c"], _gathered(1, 2)[0][1].to(torch.bfloat16))
        del buffers
        conn.send(None)
        conn.recv()
    finally:
        rank.join(timeout=30)


def test_a_fused_moe_layers_reported_names_count_its_experts_as_written():
    """vLLM 0.26's fused-MoE layer reports its experts' weights without their `routed_experts.` module:
    the engine's check that a sync rewrote every freed weight reads them as the parameters they are."""
    from rlsys.rollout.vllm_compat import loaded_parameters

    reported = {"model.layers.0.mlp.experts.w13_weight", "model.layers.0.mlp.gate.weight",
                "model.layers.1.mlp.experts.routed_experts.w2_weight"}
    assert loaded_parameters(reported) == reported | {"model.layers.0.mlp.experts.routed_experts.w13_weight"}
