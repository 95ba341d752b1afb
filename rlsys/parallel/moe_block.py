"""The MoE block rlsys trains: HF's router and experts, computed with grouped matrix
products, tokens sent to the ranks holding their experts under expert parallel, and the
router's load-balancing loss taken over every data-parallel rank's tokens.

`MoEBlock` takes the place of a family's sparse MoE block (`mlp`) and takes over its modules
under their own names (`gate`, `experts`, a shared expert), so parameter names, checkpoints
and the weight sync stay HF's. Its output is HF's: the same router (softmax, top-k,
optionally renormalised) and the same experts, computed grouped rather than one at a time.

Expert parallel (`parallel.ep`): each rank of an ep group holds E / ep experts. A rank sorts
its tokens' (token, expert) assignments by expert, sends each to the rank holding that expert
with an all-to-all (autograd: gradients come back the same way), runs its experts on what it
received with grouped matrix products and sends the results back (torchtitan's
token dispatch, `models/common/token_dispatcher.py`).

Under tensor parallel the block runs on this rank's share of the sequence (tokens are split
between the tp ranks, experts are not): the router and a shared expert are replicated over
tp, their gradients summed by DTensor, the experts' by FSDP over the ranks that hold them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import DTensor, Shard

from rlsys.models.moe import moe_layer_indices


class RouterBalance:
    """The load-balancing loss of every MoE layer of a model part, and its router metrics.

    Per layer it is the Switch Transformer loss as HF computes it, E * sum_i f_i * P_i (f_i the
    share of the top-k assignments that go to expert i, P_i the mean router probability of
    expert i, over the non-padding tokens of the forward pass), taken over the tokens of every
    data-parallel, context-parallel and tensor-parallel rank of the pass: each rank's f is all-
    reduced first. (Per shard the loss is a different, larger one.) The loss added to the
    training loss is `coef` times its mean over MoE layers and passes. Its gradient is added in
    backward through each block's output (Megatron's auxiliary-loss scaler), so it needs no
    place in the loss function and reaches the layers of every pipeline stage."""

    def __init__(self, coef: float, num_layers: int, group):
        self.coef, self.num_layers, self.group = coef, num_layers, group
        """`num_layers`: MoE layers of the whole model (a pipeline stage holds some of them)."""
        self.scale = 0.0
        """d(training loss) / d(one layer's loss in this pass): coef / (layers x passes); 0 in a
        pass that adds nothing."""
        self.records: list[torch.Tensor] = []
        """[loss, max load] of each layer and pass since the last `take`."""

    def start(self, passes: int) -> None:
        self.scale = self.coef / (self.num_layers * passes)

    def skip_pass(self) -> None:
        self.scale = 0.0

    def take(self) -> torch.Tensor:
        """Sums over the recorded layers and passes: [loss, max load, count]; then forgets them."""
        if not self.records:
            return torch.zeros(3)
        stacked = torch.stack(self.records)
        self.records = []
        return torch.cat([stacked.sum(0), torch.tensor([float(len(stacked))])])

    def attach(self, output: torch.Tensor, probs: torch.Tensor, chosen: torch.Tensor,
               valid: torch.Tensor) -> torch.Tensor:
        """`output` with this layer's loss attached to its backward. `probs` [N, E] the router's
        probabilities, `chosen` [N, k] the experts picked, `valid` [N] the non-padding tokens."""
        num_experts = probs.shape[1]
        valid = valid.to(probs.dtype)
        with torch.no_grad():
            counts = torch.zeros(num_experts, dtype=probs.dtype, device=probs.device)
            counts.index_add_(0, chosen.reshape(-1), valid.repeat_interleave(chosen.shape[1]))
            totals = torch.cat([counts, (probs * valid[:, None]).sum(0), valid.sum()[None]])
            if dist.get_world_size(self.group) > 1:
                dist.all_reduce(totals, group=self.group)
            tokens = totals[-1].clamp(min=1)
            load = totals[:num_experts] / tokens
        local = num_experts * (load * (probs * valid[:, None]).sum(0)).sum() / tokens
        if _in_backward():  # activation checkpointing recomputes the block: its loss is recorded once
            return _AuxLossScaler.apply(output, local, self.scale)
        loss = num_experts * (load * totals[num_experts:-1] / tokens).sum()
        top_k = chosen.shape[1]
        self.records.append(torch.stack([loss, load.max() * num_experts / top_k]).detach().cpu())
        return _AuxLossScaler.apply(output, local, self.scale)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class _AuxLossScaler(torch.autograd.Function):
    """Identity on a block's output; in backward also d(scale x aux) / d(aux) = scale into the aux loss."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.aux_dtype, ctx.scale = aux.dtype, scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.tensor(ctx.scale, dtype=ctx.aux_dtype, device=grad.device), None


class GroupedExperts(nn.Module):
    """A layer's experts, `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] (HF's fused
    parameters, under their names), run as grouped matrix products over tokens sorted by expert.
    Under expert parallel the parameters are DTensors split over the ep ranks by expert."""

    def __init__(self, hf_experts: nn.Module):
        super().__init__()
        self.gate_up_proj, self.down_proj = hf_experts.gate_up_proj, hf_experts.down_proj
        self.act_fn = hf_experts.act_fn
        self.num_experts = hf_experts.gate_up_proj.shape[0]
        self.ep_group = None
        """The expert-parallel process group (set by `expert_parallel.apply_ep`); None: every expert here."""

    def forward(self, tokens: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """tokens [N, H], chosen experts [N, k], their weights [N, k] -> [N, H]."""
        order = chosen.reshape(-1).argsort(stable=True)
        token_of = order // chosen.shape[1]
        counts = torch.bincount(chosen.reshape(-1), minlength=self.num_experts)
        routed = tokens[token_of]
        if self.ep_group is None:
            outputs = self._compute(routed, counts)
        else:
            outputs = self._dispatch_and_compute(routed, counts)
        outputs = outputs * weights.reshape(-1)[order, None].to(outputs.dtype)
        return torch.zeros_like(tokens).index_add_(0, token_of, outputs)

    def _compute(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The local experts on `routed` tokens, sorted by expert, `counts` of each."""
        gate_up, down = _local(self.gate_up_proj), _local(self.down_proj)
        offsets = counts.cumsum(0).to(torch.int32)
        gate, up = F.grouped_mm(routed, gate_up.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
        return F.grouped_mm(self.act_fn(gate) * up, down.transpose(1, 2), offs=offsets)

    def _dispatch_and_compute(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Send each routed token to the rank holding its expert, compute there, and bring the
        results back in `routed`'s order."""
        group, ep = self.ep_group, dist.get_world_size(self.ep_group)
        local_experts = self.num_experts // ep
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=group)  # [source rank, local expert]
        send = counts.view(ep, local_experts).sum(1).tolist()
        received_by_rank = received_counts.view(ep, local_experts)
        receive = received_by_rank.sum(1).tolist()
        received = all_to_all_single_autograd(routed, receive, send, group)
        # rank-major (source rank, then expert) -> expert-major for the grouped products, and back
        source_expert = torch.repeat_interleave(torch.arange(ep * local_experts, device=routed.device) % local_experts,
                                                received_by_rank.reshape(-1))
        by_expert = source_expert.argsort(stable=True)
        computed = self._compute(received[by_expert], received_by_rank.sum(0))
        back = torch.empty_like(computed).index_copy_(0, by_expert, computed)
        return all_to_all_single_autograd(back, send, receive, group)


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a parameter (split over ep as a DTensor, else all of them)."""
    return param.to_local() if isinstance(param, DTensor) else param


class MoEBlock(nn.Module):
    """A family's sparse MoE block: `gate` (the router), `experts`, and Qwen2-MoE's
    `shared_expert` with its `shared_expert_gate`."""

    def __init__(self, hf_block: nn.Module):
        super().__init__()
        router = hf_block.gate
        self.gate = router
        self.experts = GroupedExperts(hf_block.experts)
        self.shared_expert = getattr(hf_block, "shared_expert", None)
        self.shared_expert_gate = getattr(hf_block, "shared_expert_gate", None)
        self.top_k = router.top_k
        self.renormalize = getattr(router, "norm_topk_prob", True)  # Mixtral always renormalises
        self.balance: RouterBalance | None = None
        self.token_mask: torch.Tensor | None = None
        """[B, T] 1 for this pass's real tokens (the engine passes it with each forward)."""
        self.tp_split: tuple[int, int] | None = None
        """(tp rank, tp size) when the tokens are split between the tensor-parallel ranks."""
        self.moe_index = 0
        """This block's place among the model's MoE blocks (its slice of a replayed routing)."""
        self.replay: torch.Tensor | None = None
        """[B, T, k] experts to route this pass's tokens to (routing replay; -1: the router's own), else None."""
        self.recorded: list[torch.Tensor] | None = None
        """When a list, each forward appends the experts it chose, [B, T', k] (T' this tp rank's
        share of T)."""
        self.agreement = torch.zeros(2)
        """Replay: [real tokens whose own top-k set equals the replayed one, real tokens] so far."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        tokens = hidden.reshape(-1, shape[-1])
        probs = F.softmax(_replicated(self.gate, tokens, lambda x: F.linear(x, self.gate.weight)), dim=-1,
                          dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.replay is not None:  # the recorded experts, weighted by this pass's router (its gradient)
            replayed = self._this_rank(self.replay).reshape(-1, self.top_k).to(chosen.device, torch.long)
            own = replayed[:, :1] < 0  # tokens the recording has no experts for: the router's own choice
            replayed = torch.where(own, chosen, replayed)
            if not _in_backward():
                self._count_agreement(chosen, replayed, shape, ~own[:, 0])
            chosen, weights = replayed, probs.gather(-1, replayed)
        if self.recorded is not None:
            self.recorded.append(chosen.detach().view(shape[0], shape[1], -1).to(torch.int16))
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.experts(tokens, chosen, weights.to(tokens.dtype))
        if self.shared_expert is not None:
            shared = _replicated(self.shared_expert, tokens, self.shared_expert)
            out = out + torch.sigmoid(_replicated(self.shared_expert_gate, tokens, self.shared_expert_gate)) * shared
        if self.balance is not None and torch.is_grad_enabled():
            out = self.balance.attach(out, probs, chosen, self._valid(shape))
        return out.reshape(shape)

    def _valid(self, shape: torch.Size) -> torch.Tensor:
        """This rank's real tokens among the block's [B, T'] (its tensor-parallel share of T)."""
        if self.token_mask is None:
            return torch.ones(shape[0] * shape[1], device=self.gate.weight.device)
        return self._this_rank(self.token_mask).reshape(-1).to(self.gate.weight.device)

    def _this_rank(self, per_token: torch.Tensor) -> torch.Tensor:
        """This tensor-parallel rank's share of a [B, T, ...] per-token tensor."""
        if self.tp_split is None:
            return per_token
        rank, size = self.tp_split
        return per_token.chunk(size, dim=1)[rank]

    def _count_agreement(self, own: torch.Tensor, replayed: torch.Tensor, shape: torch.Size,
                         recorded: torch.Tensor) -> None:
        """Among the real tokens the recording routes (`recorded`), those whose own top-k set is the replayed."""
        same = (own.sort(-1).values == replayed.sort(-1).values).all(-1).float()
        valid = self._valid(shape).to(same.device) * recorded.to(same.device)
        self.agreement += torch.stack([(same * valid).sum(), valid.sum()]).detach().cpu()


def _replicated(module: nn.Module, tokens: torch.Tensor, fn) -> torch.Tensor:
    """`fn(tokens)` for a module whose parameters are replicated over tensor parallel (DTensors)
    while each tp rank holds its own tokens: computed as a DTensor split by token, so DTensor
    sums the parameters' gradients over the tp ranks."""
    weight = next(module.parameters())
    if not isinstance(weight, DTensor):
        return fn(tokens)
    return fn(DTensor.from_local(tokens, weight.device_mesh, [Shard(0)])).to_local()


def moe_blocks(model: nn.Module) -> list[MoEBlock]:
    return [module for module in model.modules() if isinstance(module, MoEBlock)]


def install_moe_blocks(model: nn.Module) -> int:
    """Put a `MoEBlock` in place of every decoder layer's sparse MoE block (`mlp` with experts);
    returns how many. A forward pre-hook on each layer takes the keywords the engine passes with
    the model's inputs (HF hands its keywords down to every layer; a recomputed layer gets them
    again): `moe_token_mask` [B, T] and, to replay a routing, `moe_routing` [B, T, MoE blocks, k]."""
    count = 0
    moe_layers = moe_layer_indices(model.config)
    for i, layer in enumerate(getattr(model.model, "layers", [])):
        if layer is None:  # another pipeline stage's
            continue
        if hasattr(getattr(layer, "mlp", None), "experts"):
            layer.mlp = MoEBlock(layer.mlp)
            layer.mlp.moe_index = moe_layers.index(i)  # among the whole model's, whichever stage holds it
            count += 1
        layer.register_forward_pre_hook(_take_moe_inputs, with_kwargs=True)
    return count


def _take_moe_inputs(layer: nn.Module, args, kwargs):
    mask = kwargs.pop("moe_token_mask", None)
    routing = kwargs.pop("moe_routing", None)
    if isinstance(layer.mlp, MoEBlock):
        layer.mlp.token_mask = mask
        layer.mlp.replay = None if routing is None else routing[:, :, layer.mlp.moe_index]
    return args, kwargs
