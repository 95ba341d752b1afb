"""The engine side of the sync: vLLM's loader places each weight the first time, its copies
are recorded and checked, and later syncs replay them (shards straight into place where the
loader copied a weight whole); shards in a training rank's shared memory are read in place."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from rlsys.sync.engine_writer import EngineWeightWriter
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


def test_a_fused_moe_layers_reported_names_count_its_experts_as_written():
    """vLLM 0.26's fused-MoE layer reports its experts' weights without their `routed_experts.` module:
    the engine's check that a sync rewrote every freed weight reads them as the parameters they are."""
    from rlsys.rollout.vllm_compat import loaded_parameters

    reported = {"model.layers.0.mlp.experts.w13_weight", "model.layers.0.mlp.gate.weight",
                "model.layers.1.mlp.experts.routed_experts.w2_weight"}
    assert loaded_parameters(reported) == reported | {"model.layers.0.mlp.experts.routed_experts.w13_weight"}
