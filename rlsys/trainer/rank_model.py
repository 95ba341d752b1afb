"""A rank's model: one rank's share of a model in its parallel layout, with
its optimizer and schedule. It knows nothing of Ray or of RL: a Ray worker
holds one per role (the policy, a frozen reference) and hands it loss
functions (`rlsys.algorithms`).

Under pipeline parallelism a rank holds one or more stages of the model
(`parts`), each with its own optimizer, and a schedule runs the loss on the
last stage (`rlsys.parallel.pipeline_schedule`); otherwise `parts` is the
one whole (sharded) model.

A loss function is pure: `loss_fn(logits, micro_batch) -> LossOutput`, its
loss already divided by GLOBAL counts (all data-parallel ranks, all
micro-batches), so summed gradients are the single-process gradient in any
layout, and its metric sums add up across data-parallel ranks the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor.parallel import loss_parallel

from rlsys.algorithms.lm_loss import LossFn, LossOutput, is_token_level
from rlsys.config.layout import ParallelConfig
from rlsys.config.model import ModelConfig
from rlsys.config.training import OptimConfig
from rlsys.data.batching import Batch, cut_rows, micro_batches, split_to_count, token_budget_sizes
from rlsys.data.image_tokens import GRIDS, IMAGE_TOKENS, PIXELS
from rlsys.data.packed_pictures import ROPE_POSITIONS, pack_pictured_rows
from rlsys.data.packing import Packing, block_causal_mask, pack_rows, rows_per_span
from rlsys.models import lora
from rlsys.models.moe import moe_layer_indices
from rlsys.models.vision import image_inputs, vision_tower
from rlsys.parallel.dims import ParallelDims
from rlsys.parallel.moe_block import RouterBalance, moe_blocks
from rlsys.parallel.pipeline_schedule import run_schedule
from rlsys.parallel.rank_sequence import (
    RankSequence,
    loss_logits,
    pad_columns,
    rank_sequence,
    unpacked_logits,
    whole_positions,
    whole_rows,
)
from rlsys.parallel.router_replay import (
    ROUTING_FIELD,
    replay_agreement,
    start_recording,
    take_recorded,
    whole_model_routing,
)
from rlsys.parallel.span_attention import SharedPrefixSpans, span_inputs, uses_span_attention
from rlsys.tracking.trace import span
from rlsys.trainer.grad_norm import clip_grad_norm
from rlsys.trainer.loading import load_parallel_model
from rlsys.trainer.schedule import lr_multiplier
from rlsys.trainer.state import RankState
from rlsys.trainer.weights import RankWeights

UPDATE_TOKENS = "perf/update_tokens"
"""The tokens a training step's forward and backward computed on every data-parallel rank (no padding, a
context its rows share counted once): beside the batch's tokens, what packing saved."""


@dataclass(frozen=True)
class RankModelSpec:
    model: ModelConfig
    optim: OptimConfig
    dims: ParallelDims
    parallel: ParallelConfig
    micro_batch_size: int
    total_steps: int
    param_dtype: torch.dtype | None
    """Compute dtype under FSDP2 mixed precision (None: the model's own)."""
    value_head: bool = False
    """A critic: a one-output value head in place of the LM head (`trainer.loading`)."""
    micro_batch_tokens: int | None = None
    """Cut micro-batches by this token budget instead of by micro_batch_size rows: a rank's
    tokens, so under context parallel cp times as many of whole sequences (as VeRL's Ulysses)."""


class RankModel:
    def __init__(self, spec: RankModelSpec, mesh: DeviceMesh, device: torch.device, trainable: bool = True):
        self.spec, self.mesh, self.device = spec, mesh, device
        self.parts = load_parallel_model(spec.model, spec.dims, mesh, spec.parallel, device, spec.param_dtype,
                                         spec.value_head)
        self.metric_group = mesh["dp_cp"].get_group()
        self.cp_group, self.cp_rank = mesh["cp"].get_group(), mesh["cp"].get_local_rank()
        self.pp_group = mesh["pp"].get_group()
        self.pp_rank = mesh["pp"].get_local_rank()
        self.vision = vision_tower(self.parts[0]) is not None
        """A vision-language model: its batches may carry pictures (`rlsys.data.image_tokens`)."""
        self.span_attention = uses_span_attention(self.parts[0])
        """Packed rows attend span by span (`rlsys.parallel.span_attention`); a model that cannot is
        not packed."""
        self.moe_blocks = [block for part in self.parts for block in moe_blocks(part)]
        self.router = self._router_balance()
        # the sequence splits evenly between tp ranks under sequence parallel and in MoE blocks
        split = spec.parallel.sequence_parallel or (self.router is not None and spec.dims.tp > 1)
        self.sequence_multiple = spec.dims.tp if split else 1
        self.fsdp_size = spec.dims.fsdp_mesh(mesh).size()
        self.fsdp_parts = [part for part in self.parts if isinstance(part, FSDPModule)]
        self.optimizers, self.schedulers = [], []
        if trainable:
            self._build_optimizers()
        else:
            for part in self.parts:
                part.eval().requires_grad_(False)
        self.weights = RankWeights(self.parts, spec.model.lora)
        """What the weight sync and the export read (`rlsys.trainer.weights`)."""
        self.state = RankState(self.parts, self.optimizers, self.schedulers, spec.model, spec.optim.lr)
        """Checkpoints (`rlsys.trainer.state`)."""

    def _build_optimizers(self) -> None:
        optim = self.spec.optim
        for part in self.parts:  # with LoRA adapters, the adapters only
            trained = [param for param in part.parameters() if param.requires_grad]
            optimizer = torch.optim.AdamW(trained, lr=optim.lr, betas=optim.betas, eps=optim.eps,
                                          weight_decay=optim.weight_decay, fused=True)
            self.optimizers.append(optimizer)
            self.schedulers.append(torch.optim.lr_scheduler.LambdaLR(
                optimizer,
                lambda step: lr_multiplier(step, optim.warmup_steps, self.spec.total_steps, optim.min_lr_ratio)))

    def _router_balance(self) -> RouterBalance | None:
        """An MoE model's load-balancing loss over its MoE layers (None for a dense model), over
        the tokens of all data-, context- and tensor-parallel ranks. Every rank of an MoE model
        has one, a pipeline stage without MoE layers too: the routers' collectives (metrics,
        replay agreement) run on every stage."""
        config = self.parts[0].config
        layers = len(moe_layer_indices(config))
        if not layers:
            return None
        coef = self.spec.model.router_aux_loss_coef
        if coef is None:
            coef = getattr(config, "router_aux_loss_coef", 0.0)
        balance = RouterBalance(coef, layers, self.mesh["token_ranks"].get_group())
        for block in self.moe_blocks:
            block.balance = balance
        return balance

    @property
    def trainable(self) -> bool:
        return bool(self.optimizers)

    @property
    def lora(self) -> bool:
        return self.spec.model.lora.rank > 0

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """This rank's parameters under their HF names (`RankWeights.named_parameters`)."""
        return self.weights.named_parameters()

    @contextlib.contextmanager
    def adapters_off(self):
        """Compute with the base model: a LoRA policy's reference, with no copy of the model."""
        for part in self.parts:
            lora.adapters_enabled(part, False)
        try:
            yield
        finally:
            for part in self.parts:
                lora.adapters_enabled(part, True)

    # -- compute --------------------------------------------------------------

    def forward_backward(self, shard: Batch, loss_fn: LossFn, forward_only: bool = False,
                         record_routing: bool = False) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        """Run `loss_fn` on every micro-batch of this rank's `shard` (and backward unless
        `forward_only`). Returns the metric sums, added up over the data-parallel ranks, and
        the per-row outputs of this shard, [rows, T] like its input_ids (on the ranks that
        compute the loss: under pipelining, the last stage). An MoE model's `record_routing`
        adds the experts each token went to (`router_replay.ROUTING_FIELD`); a shard holding
        that field routes its tokens to them (`rlsys.parallel.router_replay`)."""
        for part in self.parts:
            part.train(not forward_only and self.trainable)
        if self.spec.dims.pp > 1:
            sums, rows = self._pipelined(shard, loss_fn, forward_only, record_routing)
        else:
            sums, rows = self._micro_batched(shard, loss_fn, forward_only, record_routing)
        for part in self.fsdp_parts:
            part.reshard()  # FSDP2 keeps the root unsharded after a forward without backward
        replayed = {}
        if ROUTING_FIELD in shard and self.router is not None:
            replayed = replay_agreement(self.moe_blocks, [self.router.group, self.pp_group], self.device)
        return {**self._sum_metrics(sums), **self._router_metrics(), **replayed}, rows

    def _router_metrics(self) -> dict[str, float]:
        """The routers' load-balancing loss (over MoE layers and passes) and their busiest
        expert's load (1 = every expert equally busy; E / top-k = one expert takes every token):
        global over the data-parallel ranks already, averaged over all layers of all stages."""
        if self.router is None:
            return {}
        totals = self.router.take()
        if dist.get_world_size(self.pp_group) > 1:
            totals = totals.to(self.device)
            dist.all_reduce(totals, group=self.pp_group)
        loss, max_load, count = totals.tolist()
        return {"router/aux_loss": loss / count, "router/max_load": max_load / count} if count else {}

    def _micro_batched(self, shard: Batch, loss_fn: LossFn, forward_only: bool, record_routing: bool = False):
        sums: dict[str, torch.Tensor] = {}
        rows: dict[str, list[torch.Tensor]] = {}
        grad = torch.no_grad() if forward_only else contextlib.nullcontext()
        packs = self._packs(loss_fn)
        reads_rows = packs and not is_token_level(loss_fn)  # the loss takes the rows, not the packing's
        micros, fillers = self._micro_batches(shard)
        passes = len(micros) + fillers
        with grad, self._loss_context():
            for index in range(passes):
                self._defer_gradient_reduction(not forward_only and index < passes - 1)
                filler = index >= len(micros)
                micro = {k: v[:1] for k, v in micros[0].items()} if filler else micros[index]
                packing = self._pack(micro) if packs else None
                seq = self._rank_sequence(packing.batch if packing else micro)
                if not (forward_only or filler):  # what packing and shared contexts leave to compute
                    sums[UPDATE_TOKENS] = sums.get(UPDATE_TOKENS, 0.0) + _computed_tokens(seq)
                if self.router is not None and filler:
                    self.router.skip_pass()
                elif self.router is not None:
                    self.router.start(passes)
                if record_routing:
                    start_recording(self.moe_blocks)
                with span("forward"):
                    out = self._loss(loss_fn, seq, micro if reads_rows else None, packing, filler)
                if not forward_only:
                    with span("backward"):
                        (out.loss * 0 if filler else out.loss).backward()
                if filler:
                    continue
                if record_routing:
                    out.rows[ROUTING_FIELD] = self._recorded_routing(seq, packing)
                for name, value in out.metrics.items():
                    sums[name] = sums.get(name, 0.0) + value.detach().float()
                for name, value in out.rows.items():  # micro-batches are trimmed: pad back to the shard's width
                    if name != ROUTING_FIELD and not reads_rows:
                        value = whole_rows(value.detach(), seq, self.cp_group)
                        value = packing.unpack(value) if packing else value
                    width = shard["input_ids"].shape[1] - value.shape[1]
                    rows.setdefault(name, []).append(pad_columns(value.cpu(), width))
        return sums, {name: torch.cat(parts) for name, parts in rows.items()}

    def _loss(self, loss_fn: LossFn, seq: RankSequence, rows: Batch | None, packing, filler: bool) -> LossOutput:
        """`loss_fn` on the forward's logits of `seq`: on its (packed) rows, or, given the
        micro-batch's `rows`, on the packed logits laid back out as those rows (a loss reading
        each row as one sequence). No reference to the logits outlives the call: the backward
        frees them as it goes."""
        logits = loss_logits(self._forward(seq, filler), seq)
        if rows is not None:
            return loss_fn(unpacked_logits(logits, packing), rows)
        return loss_fn(logits, seq.fields)

    def _recorded_routing(self, seq: RankSequence, packing) -> torch.Tensor:
        """The experts the last forward routed `seq`'s tokens to, [B, T, MoE layers, k] for the
        micro-batch's rows as they were before packing and context parallel."""
        routing = whole_positions(take_recorded(self.moe_blocks, self.mesh["tp"].get_group()), seq, self.cp_group)
        routing = packing.unpack(routing, per_label=False) if packing else routing
        return routing.to(torch.int16)

    def _micro_batches(self, shard: Batch) -> tuple[list[Batch], int]:
        """The shard's micro-batches, and how many passes that add nothing to run after them.
        Under a token budget (VeRL's dynamic batch size) the data-parallel ranks may need
        different numbers of micro-batches, while each pass's FSDP collectives pair up across
        them: every rank runs as many passes as the rank that needs most, splitting its largest
        micro-batches first and, once each is a single row, padding with zero-loss passes."""
        if self.spec.micro_batch_tokens is None:
            return micro_batches(shard, self.spec.micro_batch_size), 0
        lengths = shard["attention_mask"].sum(1).tolist()
        sizes = self._token_budget_sizes(lengths)
        count = self._most_over_data_parallel(len(sizes))
        sizes = split_to_count(sizes, lengths, count)
        return cut_rows(shard, sizes), count - len(sizes)

    def _token_budget_sizes(self, lengths: list[int]) -> list[int]:
        """Rows per micro-batch under the token budget: a rank's tokens, so under context
        parallel cp times as many of whole sequences."""
        return token_budget_sizes(lengths, self.spec.micro_batch_tokens * self.spec.dims.cp)

    def _most_over_data_parallel(self, count: int) -> int:
        """The largest `count` of the data-parallel (and context-parallel) ranks."""
        if dist.get_world_size(self.metric_group) == 1:
            return count
        largest = torch.tensor(count, device=self.device)  # the group may be nccl
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=self.metric_group)
        return int(largest)

    def _pipeline_micro_batches(self, shard: Batch) -> int:
        """Micro-batches the pipeline schedule splits this shard into: parallel.pp_microbatches,
        or under a token budget as many as the budget needs, at least pp_microbatches (which
        keeps the bubble small), a multiple of pp for the interleaved schedule, and the same on
        every data-parallel rank (their FSDP collectives pair up pass by pass). The schedule's
        micro-batches are equal in rows and as wide as the shard, so the budget bounds them
        only roughly."""
        parallel = self.spec.parallel
        if self.spec.micro_batch_tokens is None:
            return parallel.pp_microbatches
        needed = len(self._token_budget_sizes(shard["attention_mask"].sum(1).tolist()))
        count = self._most_over_data_parallel(max(needed, parallel.pp_microbatches))
        if parallel.pp_schedule == "interleaved_1f1b":
            count = -(-count // parallel.pp) * parallel.pp
        return count

    def _pipelined(self, shard: Batch, loss_fn: LossFn, forward_only: bool, record_routing: bool = False):
        parallel = self.spec.parallel
        num_microbatches = self._pipeline_micro_batches(shard)
        seq = self._rank_sequence(shard)
        for stage in self.parts:
            stage.positions = seq.positions.to(self.device)
        activation_dtype = self.spec.param_dtype or next(self.parts[0].parameters()).dtype
        if self.router is not None:
            self.router.start(num_microbatches)
        routing = seq.fields.get(ROUTING_FIELD)
        fields = {name: value for name, value in seq.fields.items() if name != ROUTING_FIELD}
        if record_routing:
            start_recording(self.moe_blocks)
        with self._loss_context(), span("pipeline_schedule", forward_only=forward_only):
            sums, rows = run_schedule(
                self.parts, self.pp_group, seq.input_ids, fields,
                lambda logits, micro: loss_fn(loss_logits(logits, seq), micro),
                parallel.pp_schedule, num_microbatches, activation_dtype, forward_only,
                self.sequence_multiple, self._token_weights(seq) if self.router is not None else None,
                None if routing is None else routing[:, :seq.input_ids.shape[1]])
        rows = {name: whole_rows(value, seq, self.cp_group) for name, value in rows.items()}
        if sums and not forward_only:  # the last stage's ranks, which sum the metrics
            sums[UPDATE_TOKENS] = _computed_tokens(seq)
        if record_routing:
            whole = whole_model_routing(self._stage_routing(seq), self.moe_blocks, self.router.num_layers,
                                        self.pp_group)
            if any(stage.is_last for stage in self.parts):  # the rank whose rows are collected
                rows[ROUTING_FIELD] = whole_positions(whole, seq, self.cp_group).to(torch.int16)
        return sums, rows

    def _stage_routing(self, seq: RankSequence) -> torch.Tensor:
        """The experts this pipeline stage's MoE layers routed `seq`'s rows to, [B, T, its layers, k]:
        none for a stage of dense layers."""
        rows, width = seq.input_ids.shape
        if not self.moe_blocks:
            top_k = self.parts[0].config.num_experts_per_tok
            return torch.zeros(rows, width, 0, top_k, dtype=torch.int32, device=self.device)
        return take_recorded(self.moe_blocks, self.mesh["tp"].get_group())[:rows]

    def _defer_gradient_reduction(self, defer: bool) -> None:
        """FSDP2 on a data-parallel mesh of one rank (there for bf16 mixed precision or tensor
        parallel, `parallelize.needs_fsdp`) shards nothing, yet every backward copies all
        gradients out to reduce them and every forward gathers the parameters again. There the
        micro-batches before the last accumulate unreduced gradients and keep the parameters
        gathered: the same gradients, the same peak memory (each backward holds both anyway).
        On more ranks each micro-batch's gradients are reduced as they come, so no rank holds
        the whole model's."""
        if self.fsdp_size > 1:
            return
        for part in self.fsdp_parts:
            part.set_requires_gradient_sync(not defer)
            part.set_reshard_after_backward(not defer)

    def _packs(self, loss_fn: LossFn) -> bool:
        """Pack sequences (`rlsys.data.packing`) outside a pipeline (whose schedule fixes every
        micro-batch's shape), for a model that attends by spans. A loss that is
        not token-level reads the packed forward's logits laid back out as its rows: whole rows,
        so not under context parallel."""
        dims = self.spec.dims
        return (self.spec.parallel.pack_sequences and dims.pp == 1 and self.span_attention
                and (dims.cp == 1 or is_token_level(loss_fn)))

    def _pack(self, micro: Batch) -> Packing:
        """`micro` packed; a vision-language model's with its pictures, and with the 3-D rotary
        positions its forward would derive from the unpacked rows (`rlsys.data.packed_pictures`)."""
        if self.vision:
            return pack_pictured_rows(micro, self.spec.parallel.share_prompts, self.parts[0])
        return pack_rows(micro, self.spec.parallel.share_prompts)

    def _rank_sequence(self, batch: Batch) -> RankSequence:
        return rank_sequence(batch, self.spec.dims.cp, self.cp_rank, self.sequence_multiple)

    def _forward(self, seq: RankSequence, filler: bool = False) -> torch.Tensor:
        """Logits of this rank's share of a micro-batch, [rows, span, vocab] (a vocabulary-sharded
        DTensor under loss parallel). Positions are passed whole: under sequence parallel HF
        would otherwise count them at the split length; a vision-language model's packed tokens
        keep the 3-D ones of their rows, and its unpacked rows' its forward derives. An MoE model's
        layers get the tokens their routers balance over (none in a pass that adds nothing)."""
        ids = seq.input_ids.to(self.device)
        positions = seq.fields["position_ids"][:, :ids.shape[1]] if "position_ids" in seq.fields \
            else seq.positions.expand_as(ids)
        if ROPE_POSITIONS in seq.fields:  # [3, rows, width]
            positions = seq.fields[ROPE_POSITIONS][:, :ids.shape[1]].permute(2, 0, 1)
        moe = {}
        if self.router is not None:
            weights = self._token_weights(seq)
            moe["moe_token_mask"] = torch.zeros_like(weights) if filler else weights
        if ROUTING_FIELD in seq.fields:
            moe["moe_routing"] = seq.fields[ROUTING_FIELD][:, :ids.shape[1]].to(self.device)
        images = self._image_inputs(seq, ids.shape[1])
        derived = images and ROPE_POSITIONS not in seq.fields  # the forward derives them from the rows
        return self.parts[0](input_ids=ids, position_ids=None if derived else positions.to(self.device),
                             use_cache=False, **self._attention_inputs(seq), **moe, **images).logits

    def _image_inputs(self, seq: RankSequence, width: int) -> dict:
        """A vision-language model's pictures in the micro-batch; where it has none and other
        data-parallel ranks may have some, a blank one that fills no token (`image_inputs`)."""
        if not self.vision:
            return {}
        fields = seq.fields
        return image_inputs(self.parts[0], fields.get(IMAGE_TOKENS), fields.get(PIXELS), fields.get(GRIDS),
                            seq.input_ids.shape[0], width, self.device, idle=self.spec.dims.dp_size > 1)

    def _token_weights(self, seq: RankSequence) -> torch.Tensor:
        """[rows, span]: how many of the batch's tokens each input token stands for: 0 for padding,
        1 for the rest, but the number of rows sharing it for a context packed once for all its
        rows (`share_prompts`): the routers' load counts the tokens of the batch, packed or not."""
        width = seq.input_ids.shape[1]
        fields = {name: value[:, :width] for name, value in seq.fields.items()}
        weights = fields["attention_mask"].float()
        if "prefix_ids" in fields:  # the rows below each span, counted over every rank's chunk
            sharing = rows_per_span(seq.whole["segment_ids"], seq.whole["prefix_ids"])
            weights = weights * sharing.to(weights.device)[fields["segment_ids"]].clamp(min=1)
        return weights

    def _attention_inputs(self, seq: RankSequence) -> dict:
        """A packed micro-batch's spans (`rlsys.parallel.span_attention`) over the whole sequence
        that context parallel's attention gathers from the ranks' chunks, built from the host copy
        of the packing (no device sync); nothing for unpacked rows under context parallel, whose
        attention is causal over the gathered right-padded sequence (a sliding-window layer's a
        span a row); else the padding mask, but under sequence parallel, where HF would build the
        mask at the split length, each row's span (a causal mask at full length for a model that
        does not attend by spans)."""
        if "segment_ids" in seq.whole:
            segments = seq.whole["segment_ids"]
            spans = SharedPrefixSpans.of(segments, seq.whole["prefix_ids"])
            return span_inputs(spans.to(self.device), *segments.shape)
        if seq.chunked:
            return {"attention_mask": None}
        mask = seq.fields["attention_mask"]
        if self.sequence_multiple == 1:
            return {"attention_mask": mask.to(self.device)}
        if self.span_attention:
            return span_inputs(SharedPrefixSpans.of_rows(mask).to(self.device), *mask.shape)
        return {"attention_mask": block_causal_mask(mask.to(self.device))}

    def _loss_context(self):
        return loss_parallel() if self.spec.parallel.loss_parallel else contextlib.nullcontext()

    def _sum_metrics(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        if not sums:  # a pipeline stage before the last: its data-parallel peers have none either
            return {}
        stacked = torch.stack([torch.as_tensor(v, device=self.device) for v in sums.values()])
        dist.all_reduce(stacked, group=self.metric_group)  # context-parallel ranks hold parts of each sum
        return dict(zip(sums, stacked.tolist()))

    @span("optimizer_step")
    def optimizer_step(self) -> dict[str, float]:
        params = [p for _, p in self.named_parameters() if p.requires_grad]
        grad_norm = clip_grad_norm(params, self.spec.optim.max_grad_norm, self.pp_group)
        lr = self.schedulers[0].get_last_lr()[0]
        for optimizer, scheduler in zip(self.optimizers, self.schedulers):
            optimizer.step()
            scheduler.step()
        self.zero_grad()
        self.weights.check_shared()
        if self.weights.shared_storages and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the engines read the shards outside this process's streams
        return {"grad_norm": grad_norm, "lr": lr}

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)


def _computed_tokens(seq: RankSequence) -> torch.Tensor:
    """The tokens this rank's forward of `seq` computes (its chunk's, under context parallel): no padding."""
    return seq.fields["attention_mask"][:, :seq.input_ids.shape[1]].sum().float()
