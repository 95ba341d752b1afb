"""A data-parallel rank of one in full precision gets no FSDP (`rlsys.parallel.parallelize.
needs_fsdp`): it computes on its parameters themselves, ties kept, with the gradients FSDP2
gives the same rank, and the same again when it recomputes its activations."""

from __future__ import annotations

import pytest
import torch
from one_rank import one_rank_results

# the quick tier (scripts/test.sh --quick); one xdist worker runs these ranks of 5-20 s each among the
# groups, not among the single tests that fill in at the end
pytestmark = [pytest.mark.quick, pytest.mark.xdist_group("fsdp_units")]


def _one_rank_steps(model_dir: str, store: str, conn) -> None:
    """A two-micro-batch step without FSDP (compute in the weights' dtype), with it (a float32
    compute dtype: FSDP2 makes the cast) and with activation checkpointing: wrapping, ties
    and gradients of each."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from rlsys.algorithms.lm_loss import nll_loss
    from rlsys.config.layout import ParallelConfig
    from rlsys.config.model import ModelConfig
    from rlsys.config.training import OptimConfig
    from rlsys.parallel.dims import ParallelDims
    from rlsys.trainer.rank_model import RankModel, RankModelSpec
    from rlsys.trainer.weights import full_tensor

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    ids = torch.randint(3, 60, (4, 12), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    results = {}
    for wrapping, param_dtype, checkpointing in (("plain", None, False), ("fsdp", torch.float32, False),
                                                 ("recomputed", None, True)):
        parallel = ParallelConfig(activation_checkpointing=checkpointing)
        dims = ParallelDims.of(parallel)
        spec = RankModelSpec(ModelConfig(path=model_dir), OptimConfig(), dims, parallel, micro_batch_size=2,
                             total_steps=1, param_dtype=param_dtype)
        rank_model = RankModel(spec, dims.build_mesh("cpu"), torch.device("cpu"))
        model = rank_model.parts[0]
        sums, _ = rank_model.forward_backward(batch, nll_loss(int(batch["loss_mask"][:, 1:].sum())))
        results[wrapping] = {
            "fsdp": isinstance(model, FSDPModule),
            "dtensors": any(isinstance(p, DTensor) for p in model.parameters()),
            "tied": model.lm_head.weight is model.model.embed_tokens.weight,
            "recomputes": model.is_gradient_checkpointing,
            "loss": sums["loss"],
            # numpy: sent by value (a tensor would be shared through this process's file descriptors)
            "grads": {name: full_tensor(p.grad).numpy() for name, p in rank_model.named_parameters()},
        }
    conn.send(results)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory) -> str:
    from rlsys.models.tiny import TinyModelSpec, write_tiny_model

    spec = TinyModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, tie_word_embeddings=True)
    return write_tiny_model(str(tmp_path_factory.mktemp("tied")), spec)


def test_one_cpu_rank_trains_its_own_parameters_with_fsdps_gradients(tied_model_dir, tmp_path):
    results = one_rank_results(_one_rank_steps, tied_model_dir, str(tmp_path / "store"))
    plain, fsdp, recomputed = results["plain"], results["fsdp"], results["recomputed"]
    assert (plain["fsdp"], plain["dtensors"]) == (False, False) and (fsdp["fsdp"], fsdp["dtensors"]) == (True, True)
    assert plain["tied"] and fsdp["tied"] and recomputed["tied"]
    assert recomputed["recomputes"] and not plain["recomputes"]
    for other in (fsdp, recomputed):
        assert plain["loss"] == pytest.approx(other["loss"], rel=1e-6)
        assert plain["grads"].keys() == other["grads"].keys()
        for name, grad in other["grads"].items():
            assert abs(grad).sum() > 0, name
            torch.testing.assert_close(torch.from_numpy(plain["grads"][name]), torch.from_numpy(grad), rtol=1e-5,
                                       atol=1e-7, msg=name)


def _head_outputs(model_dir: str, store: str, conn) -> None:
    """The LM head's input, weight (as it multiplies it) and output in a bf16 mixed-precision
    step, with and without `model.fp32_lm_head`, and whether gradients reached the weights."""
    import torch.distributed as dist

    from rlsys.algorithms.lm_loss import nll_loss
    from rlsys.config.layout import ParallelConfig
    from rlsys.config.model import ModelConfig
    from rlsys.config.training import OptimConfig
    from rlsys.parallel.dims import ParallelDims
    from rlsys.trainer.rank_model import RankModel, RankModelSpec
    from rlsys.trainer.weights import full_tensor

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    ids = torch.randint(3, 60, (2, 12), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    results = {}
    for fp32_head in (False, True):
        parallel = ParallelConfig()
        dims = ParallelDims.of(parallel)
        spec = RankModelSpec(ModelConfig(path=model_dir, fp32_lm_head=fp32_head), OptimConfig(), dims, parallel,
                             micro_batch_size=2, total_steps=1, param_dtype=torch.bfloat16)
        rank_model = RankModel(spec, dims.build_mesh("cpu"), torch.device("cpu"))
        seen = {}
        rank_model.parts[0].lm_head.register_forward_hook(lambda module, args, out: seen.update(
            hidden=args[0].detach().clone(), weight=module.weight.detach().clone(), logits=out.detach().clone()))
        rank_model.forward_backward(batch, nll_loss(int(batch["loss_mask"][:, 1:].sum())))
        grads = [full_tensor(p.grad) for _, p in rank_model.named_parameters()]
        results[fp32_head] = {**{k: v.float().numpy() for k, v in seen.items()},
                              "dtypes": (seen["hidden"].dtype, seen["weight"].dtype, seen["logits"].dtype),
                              "all_grads": all(g is not None and g.abs().sum() > 0 for g in grads)}
    conn.send(results)
    dist.destroy_process_group()


def test_fp32_lm_head_multiplies_the_bf16_operands_in_fp32(tied_model_dir, tmp_path):
    results = one_rank_results(_head_outputs, tied_model_dir, str(tmp_path / "store"))
    rounded, fp32 = results[False], results[True]
    assert rounded["dtypes"] == (torch.bfloat16, torch.bfloat16, torch.bfloat16)
    assert fp32["dtypes"] == (torch.bfloat16, torch.bfloat16, torch.float32)  # FSDP's cast weight, fp32 logits
    exact = torch.from_numpy(fp32["hidden"]) @ torch.from_numpy(fp32["weight"]).T
    torch.testing.assert_close(torch.from_numpy(fp32["logits"]), exact, rtol=1e-6, atol=1e-6)
    assert not torch.equal(exact.to(torch.bfloat16).float(), exact)  # the rounding it removes is there to remove
    assert rounded["all_grads"] and fp32["all_grads"]


def _offloaded_steps(model_dir: str, store: str, conn) -> None:
    """Two training steps with FSDP2, with and without `parallel.offload`: the gradients of each
    backward, the parameters after each optimizer step, and which offload policy the units got."""
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    from rlsys.algorithms.lm_loss import nll_loss
    from rlsys.config.layout import ParallelConfig
    from rlsys.config.model import ModelConfig
    from rlsys.config.training import OptimConfig
    from rlsys.parallel.dims import ParallelDims
    from rlsys.trainer.rank_model import RankModel, RankModelSpec
    from rlsys.trainer.weights import full_tensor

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    ids = torch.randint(3, 60, (4, 12), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    results = {}
    for offload in (False, True):
        parallel = ParallelConfig(offload=offload)
        dims = ParallelDims.of(parallel)
        spec = RankModelSpec(ModelConfig(path=model_dir), OptimConfig(lr=1e-2, warmup_steps=0), dims, parallel,
                             micro_batch_size=2, total_steps=2, param_dtype=torch.float32)
        rank_model = RankModel(spec, dims.build_mesh("cpu"), torch.device("cpu"))
        units = [m for m in rank_model.parts[0].modules() if isinstance(m, FSDPModule)]
        steps = []
        for _ in range(2):
            rank_model.forward_backward(batch, nll_loss(int(batch["loss_mask"][:, 1:].sum())))
            grads = {name: full_tensor(p.grad).numpy().copy() for name, p in rank_model.named_parameters()}
            rank_model.optimizer_step()
            params = {name: full_tensor(p).detach().numpy().copy() for name, p in rank_model.named_parameters()}
            steps.append({"grads": grads, "params": params})
        results[offload] = {"steps": steps, "units": len(units),
                            "offloaded": [isinstance(u._get_fsdp_state()._fsdp_param_group.offload_policy,
                                                     CPUOffloadPolicy) for u in units]}
    conn.send(results)
    dist.destroy_process_group()


def test_offload_gives_the_same_steps(tied_model_dir, tmp_path):
    """`parallel.offload` (FSDP2's CPUOffloadPolicy, a unit per block; the optimizer steps on the host)
    trains exactly as FSDP2 without it: each step's gradients and parameters within 1e-6."""
    results = one_rank_results(_offloaded_steps, tied_model_dir, str(tmp_path / "store"))
    kept, offloaded = results[False], results[True]
    assert offloaded["units"] == 3 and all(offloaded["offloaded"])  # two decoder blocks and the root
    assert not any(kept["offloaded"])
    for step, (a, b) in enumerate(zip(kept["steps"], offloaded["steps"])):
        for kind in ("grads", "params"):
            for name, value in a[kind].items():
                torch.testing.assert_close(torch.from_numpy(b[kind][name]), torch.from_numpy(value), rtol=1e-6,
                                           atol=1e-6, msg=f"step {step} {kind} {name}")
    moved = kept["steps"][1]["params"]["model.norm.weight"] - kept["steps"][0]["params"]["model.norm.weight"]
    assert abs(moved).max() > 0  # the second step changed the weights


def _random_init_draws(model_dir: str, store: str, conn) -> None:
    """The parameters of `model.random_init` from a directory without weights, twice with one seed."""
    import torch.distributed as dist

    from rlsys.config.layout import ParallelConfig
    from rlsys.config.model import ModelConfig
    from rlsys.config.training import OptimConfig
    from rlsys.parallel.dims import ParallelDims
    from rlsys.trainer.rank_model import RankModel, RankModelSpec
    from rlsys.trainer.weights import full_tensor

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    draws = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        parallel = ParallelConfig()
        dims = ParallelDims.of(parallel)
        spec = RankModelSpec(ModelConfig(path=model_dir, random_init=True), OptimConfig(), dims, parallel,
                             micro_batch_size=2, total_steps=1, param_dtype=None)
        rank_model = RankModel(spec, dims.build_mesh("cpu"), torch.device("cpu"))
        draws.append({name: full_tensor(p).detach().numpy().copy() for name, p in rank_model.named_parameters()})
    conn.send(draws)
    dist.destroy_process_group()


def test_random_init_draws_from_the_seed_without_weights(tied_model_dir, tmp_path):
    """`model.random_init` needs only config.json: norms 1, biases 0, the rest normal(0, initializer_range),
    the same again from the same seed and other weights from another."""
    import shutil

    config_only = tmp_path / "config_only"
    config_only.mkdir()
    shutil.copy(f"{tied_model_dir}/config.json", config_only)
    first, again, other = one_rank_results(_random_init_draws, str(config_only), str(tmp_path / "store"))
    assert first.keys() == again.keys() == other.keys()
    for name, value in first.items():
        assert (value == again[name]).all(), name
        if name.endswith("norm.weight"):
            assert (value == 1).all(), name
        elif name.endswith(".bias"):
            assert (value == 0).all(), name
        else:
            assert abs(value.std() - 0.02) < 0.005 and not (value == other[name]).all(), name
