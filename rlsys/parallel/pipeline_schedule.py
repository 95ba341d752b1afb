"""Running a loss function through a pipeline schedule.

The schedule splits this data-parallel rank's shard into micro-batches, runs
them through the stages and calls the loss on the last stage. It chunks one
`target` tensor along the rows, so the micro-batch's per-token fields (token
ids, masks, advantages, old and reference log-probs) travel packed along a
last dimension and are unpacked for the loss function, which stays the same
pure function the unpipelined engine calls. Stages are made for each call
with static shapes (no shape-inference pass): a batch's length changes from
step to step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from rlsys.algorithms.lm_loss import LossOutput
from rlsys.data.batching import Batch
from rlsys.parallel.pipeline_stages import DecoderStage

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


def run_schedule(stages: list[DecoderStage], group: ProcessGroup, input_ids: torch.Tensor, fields: Batch, loss_fn,
                 schedule: str, num_microbatches: int, activation_dtype: torch.dtype, forward_only: bool,
                 sequence_split: int = 1, token_weights: torch.Tensor | None = None,
                 routing: torch.Tensor | None = None) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Runs the first stage on `input_ids` [B, T] and `loss_fn` on the last stage's logits and
    `fields` (per-token, [B, T', ...] each), micro-batch by micro-batch. Activations between stages
    are [B, T / sequence_split, hidden] (sequence parallel splits them between the tensor-
    parallel ranks). `token_weights` [B, T]: an MoE model's real tokens, for its routers'
    balance; `routing` [B, T, MoE layers, k]: the experts to route each token to (routing replay).
    Returns this rank's metric sums and per-row outputs (empty unless it holds the
    last stage)."""
    rows = input_ids.shape[0]
    input_ids, fields = _pad_rows(input_ids, num_microbatches), _pad_fields(fields, num_microbatches)
    micro_rows = input_ids.shape[0] // num_microbatches
    device = next(stages[0].parameters()).device
    for stage in stages:
        stage.forwards = 0
        if token_weights is not None:
            stage.token_masks = list(_pad_rows(token_weights, num_microbatches).split(micro_rows))
        stage.routings = [] if routing is None else \
            [part.to(device) for part in _pad_rows(routing, num_microbatches).split(micro_rows)]
    shapes = _StageShapes(micro_rows, input_ids.shape[1], sequence_split, activation_dtype, not forward_only)
    pipeline_stages = [_pipeline_stage(stage, group, shapes, device) for stage in stages]
    recorder = _LossRecorder(loss_fn, fields)
    schedule_cls = SCHEDULES[schedule]
    runner = schedule_cls(pipeline_stages if schedule_cls is ScheduleInterleaved1F1B else pipeline_stages[0],
                          n_microbatches=num_microbatches, loss_fn=recorder, scale_grads=False)
    args = (input_ids.to(device),) if any(s.is_first for s in stages) else ()
    target = _pack(fields).to(device) if any(s.is_last for s in stages) else None
    # a schedule's first run sets every parameter's grad to None: keep what earlier calls accumulated
    kept = {p: p.grad for stage in stages for p in stage.parameters() if p.grad is not None}
    if forward_only:
        with torch.no_grad():
            runner.eval(*args, target=target, losses=[])
    else:
        runner.step(*args, target=target, losses=[])
    for param, grad in kept.items():
        param.grad = grad if param.grad is None else param.grad.add_(grad)
    return recorder.sums(), {name: value[:rows] for name, value in recorder.rows().items()}


@dataclass(frozen=True)
class _StageShapes:
    micro_rows: int
    length: int
    sequence_split: int
    activation_dtype: torch.dtype
    has_backward: bool


def _pipeline_stage(stage: DecoderStage, group: ProcessGroup, shapes: _StageShapes,
                    device: torch.device) -> PipelineStage:
    """A stage with its input and output shapes given (static: no shape-inference pass). Activations
    passed between stages must say they require grad, or no gradient is sent back for them."""
    rows, length = shapes.micro_rows, shapes.length
    hidden = torch.empty(rows, length // shapes.sequence_split, stage.config.hidden_size,
                         dtype=shapes.activation_dtype, device="meta", requires_grad=shapes.has_backward)
    inputs = torch.empty(rows, length, dtype=torch.long, device="meta") if stage.is_first else hidden
    outputs = torch.empty(rows, length, stage.config.vocab_size, dtype=shapes.activation_dtype, device="meta") \
        if stage.is_last else hidden
    return PipelineStage(stage, stage.index, stage.num_stages, device, input_args=inputs, output_args=outputs,
                         group=group)


def _pad_rows(value: torch.Tensor, multiple: int) -> torch.Tensor:
    """Rows of padding (all masks 0) so the schedule's micro-batches are equal."""
    return F.pad(value, (0, 0) * (value.dim() - 1) + (0, -value.shape[0] % multiple))


def _pad_fields(fields: Batch, multiple: int) -> Batch:
    return {name: _pad_rows(value, multiple) for name, value in fields.items()}


def _pack(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B, T, columns] float64, a field's trailing dimensions flattened into its columns: exact for
    token ids and fp32 values alike."""
    return torch.cat([value.double().reshape(*value.shape[:2], -1) for value in batch.values()], dim=-1)


class _LossRecorder:
    """The schedule's loss function: unpacks the micro-batch, calls the engine's loss
    function and keeps its metrics and per-row outputs."""

    def __init__(self, loss_fn, fields: Batch):
        """`fields`: the batch whose layout `_pack` flattened (each field's dtype and trailing shape)."""
        self.loss_fn = loss_fn
        self.fields = {name: (value.dtype, value.shape[2:]) for name, value in fields.items()}
        self.outputs: list[LossOutput] = []

    def __call__(self, logits: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        micro, column = {}, 0
        for name, (dtype, trailing) in self.fields.items():
            width = trailing.numel()
            micro[name] = packed[..., column:column + width].reshape(*packed.shape[:2], *trailing).to(dtype)
            column += width
        out = self.loss_fn(logits, micro)
        self.outputs.append(LossOutput(None, {k: v.detach() for k, v in out.metrics.items()},
                                       {k: v.detach().cpu() for k, v in out.rows.items()}))
        return out.loss if out.loss is not None else logits.new_zeros(())

    def sums(self) -> dict[str, torch.Tensor]:
        totals: dict[str, torch.Tensor] = {}
        for out in self.outputs:
            for name, value in out.metrics.items():
                totals[name] = totals.get(name, 0.0) + value.float()
        return totals

    def rows(self) -> dict[str, torch.Tensor]:
        names = self.outputs[0].rows if self.outputs else {}
        return {name: torch.cat([out.rows[name] for out in self.outputs]) for name in names}
