"""Routing replay for MoE RL: the experts each token went to in the pass the update is compared
with are recorded, per token and MoE layer, and the update's forwards route every token to those
experts again, weighted by the current router's probabilities of them (so the router still
learns). Without it the update's router may pick other experts for the same token than the pass
it is compared with, and the PPO ratio measures the change of routing rather than of the policy.
R2 records the trainer's own old-log-prob pass; R3 takes the rollout engine's routing, which the
engine returns with each completion (`engine_routing`), so that the trainer computes what the
engine sampled from.

The recorded routing travels with the batch as one more per-token field, `routed_experts`
[B, T, MoE layers, k] (int16), cut, packed and split over context-parallel ranks as every field
is; the engine hands it to the model (under pipeline parallel, each stage its micro-batches'),
each MoE block takes its layer's slice and, under tensor parallel, its rank's share of the tokens
(`MoEBlock.replay`). Recorded under pipeline parallel, each stage's layers are its own, and the
stages put the whole model's routing together (`whole_model_routing`). A token whose experts are -1 (one the
engine did not compute: a response's last, a tool turn after the last model turn, padding) goes
where the trainer's router sends it.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from rlsys.parallel.moe_block import MoEBlock

ROUTING_FIELD = "routed_experts"
OWN_CHOICE = -1
"""A replayed routing's experts for a token the router routes itself."""


def engine_routing(routings: list[np.ndarray | None], width: int, moe_layers: list[int], top_k: int
                   ) -> torch.Tensor:
    """The batch field R3 replays, [rows, width, MoE layers, top_k] (int16), from each row's engine
    routing [tokens, hidden layers, top_k] (or None) of its first tokens; `moe_layers`: the hidden
    layers whose MLP is an MoE block, in the model's order. Tokens without a routing get `OWN_CHOICE`."""
    field = torch.full((len(routings), width, len(moe_layers), top_k), OWN_CHOICE, dtype=torch.int16)
    for row, routing in enumerate(routings):
        if routing is not None:
            tokens = min(len(routing), width)
            field[row, :tokens] = torch.from_numpy(routing[:tokens, moe_layers].astype(np.int16))
    return field


def without_routing(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`batch` for a model whose routers are not the policy's (the reference, the critic): the
    policy's routing is not replayed there."""
    return {name: value for name, value in batch.items() if name != ROUTING_FIELD}


def start_recording(blocks: list[MoEBlock]) -> None:
    for block in blocks:
        block.recorded = []


def take_recorded(blocks: list[MoEBlock], tp_group) -> torch.Tensor:
    """The experts the blocks chose in the forwards since recording started (micro-batches in
    order, their rows one after another), [B, T, the blocks, k] for the model's whole input
    (gathered over the tensor-parallel ranks that split its tokens), int32 (what gloo and nccl
    gather); stops recording."""
    chosen = torch.stack([torch.cat(block.recorded) for block in blocks], dim=2).to(torch.int32)
    for block in blocks:
        block.recorded = None
    if blocks[0].tp_split is not None:
        parts = [torch.empty_like(chosen) for _ in range(dist.get_world_size(tp_group))]
        dist.all_gather(parts, chosen.contiguous(), group=tp_group)
        chosen = torch.cat(parts, dim=1)
    return chosen


def replay_agreement(blocks: list[MoEBlock], groups: list, device: torch.device) -> dict[str, float]:
    """router/replay_agreement: the share of (real token, MoE layer) pairs of the passes since the
    last call whose replayed experts are the set the router would have chosen itself, over every
    rank of `groups` (the ranks sharing the batch, the pipeline stages) (none without a replay);
    resets the counts."""
    totals = sum((block.agreement for block in blocks), torch.zeros(2))
    for block in blocks:
        block.agreement = torch.zeros(2)
    totals = totals.to(device)
    for group in groups:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(totals, group=group)
    agree, count = totals.tolist()
    return {"router/replay_agreement": agree / count} if count else {}


def whole_model_routing(stage_routing: torch.Tensor, blocks: list[MoEBlock], num_layers: int,
                        pp_group) -> torch.Tensor:
    """Under pipeline parallel: a stage's recorded routing [B, T, its blocks, k] placed among every
    MoE layer of the model, [B, T, num_layers, k], the other stages' columns filled in by theirs."""
    rows, length, _, top_k = stage_routing.shape
    whole = torch.zeros(rows, length, num_layers, top_k, dtype=stage_routing.dtype, device=stage_routing.device)
    whole[:, :, [block.moe_index for block in blocks]] = stage_routing
    if dist.get_world_size(pp_group) > 1:
        dist.all_reduce(whole, group=pp_group)  # each column is one stage's; the others add zeros
    return whole
