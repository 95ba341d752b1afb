"""The update's packed micro-batches attend span by span: a training rank builds no mask of a
packed row's width, neither its own nor transformers', and gives the padded rows' loss and
gradients."""

from __future__ import annotations

import pytest
import torch
from one_rank import one_rank_results

pytestmark = [pytest.mark.quick, pytest.mark.xdist_group("fsdp_units")]


def _rl_batch():
    """Two GRPO groups of 4 samples of a 6-token prompt (answers of 1-4 tokens) and two lone rows."""
    from rlsys.data.batching import collate_rollouts

    generator = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(3, 100, (n,), generator=generator).tolist()  # noqa: E731
    prompts = [ids(6), ids(6), ids(3), ids(9)]
    group_of = [0, 0, 0, 0, 1, 1, 1, 1, 2, 3]
    return collate_rollouts([prompts[g] for g in group_of], [ids(1 + i % 4) for i in range(10)], pad_id=0)


def _attention_calls(model_dir: str, store: str, conn) -> None:
    """One rank's forward and backward of the NLL over `_rl_batch`, packed and padded, recording
    every SDPA call's mask shape and every mask transformers builds."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from transformers import masking_utils

    from rlsys.algorithms.lm_loss import nll_loss
    from rlsys.config.layout import ParallelConfig
    from rlsys.config.model import ModelConfig
    from rlsys.config.training import OptimConfig
    from rlsys.data.packing import pack_rows
    from rlsys.parallel.dims import ParallelDims
    from rlsys.trainer import rank_model as rank_model_module
    from rlsys.trainer.weights import full_tensor

    calls, built = [], []
    sdpa, hf_mask = F.scaled_dot_product_attention, masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]

    def recording_sdpa(query, key, value, attn_mask=None, **kwargs):
        calls.append(None if attn_mask is None else tuple(attn_mask.shape))
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    def recording_mask(*args, **kwargs):
        mask = hf_mask(*args, **kwargs)
        built.append(None if mask is None else tuple(mask.shape))
        return mask

    def refused(*args, **kwargs):
        raise AssertionError("a dense block-causal mask was built")

    F.scaled_dot_product_attention = recording_sdpa
    masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping["sdpa"] = recording_mask
    rank_model_module.block_causal_mask = refused
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    batch = _rl_batch()
    results = {"widths": [pack_rows(batch, share).batch["input_ids"].shape[1] for share in (True, False)]}
    for name, pack, share in (("shared", True, True), ("packed", True, False), ("padded", False, False)):
        calls.clear(), built.clear()
        parallel = ParallelConfig(pack_sequences=pack, share_prompts=share)
        dims = ParallelDims.of(parallel)
        spec = rank_model_module.RankModelSpec(ModelConfig(path=model_dir), OptimConfig(), dims, parallel,
                                               micro_batch_size=10, total_steps=1, param_dtype=None)
        rank_model = rank_model_module.RankModel(spec, dims.build_mesh("cpu"), torch.device("cpu"))
        sums, _ = rank_model.forward_backward(batch, nll_loss(int(batch["loss_mask"][:, 1:].sum())))
        results[name] = {"loss": sums["loss"], "sdpa_masks": list(calls), "built": list(built),
                         "grads": {name: full_tensor(p.grad).numpy() for name, p in rank_model.named_parameters()}}
    conn.send(results)
    dist.destroy_process_group()


def test_a_packed_update_builds_no_mask_of_the_rows_width(tiny_model_dir, tmp_path):
    """Packed with the groups' prompts shared and packed plainly, every attention call takes spans:
    causal ones without a mask, those continuing a prompt a mask of their own [queries x keys],
    none of the row's width; transformers builds no mask; loss and gradients are the padded
    rows' within 1e-6."""
    results = one_rank_results(_attention_calls, tiny_model_dir, str(tmp_path / "store"))
    padded = results["padded"]
    for name, width in zip(("shared", "packed"), results["widths"]):
        packed = results[name]
        assert packed["built"] == [], name
        assert None in packed["sdpa_masks"], name
        assert all(mask is None or (mask[-2] < width and mask[-1] < width) for mask in packed["sdpa_masks"]), name
        assert packed["loss"] == pytest.approx(padded["loss"], rel=1e-6)
        for key, grad in padded["grads"].items():
            gap = abs(torch.from_numpy(packed["grads"][key]) - torch.from_numpy(grad)).max()
            assert gap <= 1e-6 * max(1.0, abs(grad).max()), (name, key)
    # the responses continuing a shared prompt: each span batch its own mask
    assert any(mask is not None for mask in results["shared"]["sdpa_masks"])
    assert all(mask is None for mask in results["packed"]["sdpa_masks"])
