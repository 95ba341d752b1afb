"""Pipeline parallelism for Hugging Face decoder models.

The decoder is cut into stages by layer: the first stage owns the embedding,
the last the final norm and the LM head, every stage its own run of decoder
blocks and the (parameter-free) rotary embedding. A stage keeps HF's module
tree with the blocks it does not own removed, so its parameter names are the
HF names (`model.layers.7.mlp.up_proj.weight`): checkpoints, HF export and
the weight sync need no renaming. `torch.distributed.pipelining` runs the
stages; its schedules hand each micro-batch's output on the last stage to the
loss function (`rlsys.parallel.pipeline_schedule`).

Stages attend causally without a padding mask: batches are right-padded, so
no real token ever sees a padding position, and padding positions are masked
out of every loss.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from rlsys.config.layout import ParallelConfig
from rlsys.models.attention import has_sliding_window
from rlsys.parallel.context_parallel import ATTENTION as ULYSSES
from rlsys.parallel.span_attention import SharedPrefixSpans, uses_span_attention

log = logging.getLogger(__name__)


def stage_layers(num_layers: int, num_stages: int) -> list[range]:
    """Decoder layers of each stage, balanced by count (earlier stages take the remainder)."""
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for stage in range(num_stages):
        size = base + (stage < extra)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def stages_per_rank(parallel: ParallelConfig) -> int:
    """Stages one pipeline rank holds under a `parallel:` config section."""
    return parallel.pp_stages_per_rank if parallel.pp > 1 and parallel.pp_schedule == "interleaved_1f1b" else 1


def rank_stage_indices(pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """The stages one pipeline rank runs: looped (rank r holds r, r + pp, ...), as the
    interleaved schedules expect."""
    return [pp_rank + pp * v for v in range(stages_per_rank)]


class DecoderStage(nn.Module):
    """Stage `index` of `num_stages`: an HF causal LM with only its own layers.

    `model` and `lm_head` are the HF model's own submodules, so parameter names stay HF's."""

    def __init__(self, causal_lm: nn.Module, layers: range, index: int, num_stages: int):
        super().__init__()
        self.config = causal_lm.config
        self._no_split_modules = causal_lm._no_split_modules
        self.index, self.num_stages, self.layers = index, num_stages, layers
        self.positions: torch.Tensor | None = None
        """Positions [1, L] of the tokens this rank's attention sees, set by the engine for each
        batch: a context-parallel chunk's, or the whole sequence's while sequence parallel splits
        the stage's input. None: 0..T-1 of the input."""
        self.token_masks: list[torch.Tensor] = []
        """An MoE model's real tokens [rows, L] of each micro-batch, in the order the schedule runs
        them forward (every schedule runs a stage's micro-batches forward in order), set by the
        schedule for each batch: the stage's MoE blocks balance their routers over them."""
        self.routings: list[torch.Tensor] = []
        """A routing to replay, [rows, L, MoE layers, k] of each micro-batch in the same order (or none)."""
        self.forwards = 0
        self.model = causal_lm.model
        for i in range(len(self.model.layers)):
            if i not in layers:
                self.model.layers[i] = None
        if index > 0:
            self.model.embed_tokens = None
        if index < num_stages - 1:
            self.model.norm = None
            self.lm_head = None
        else:
            self.lm_head = causal_lm.lm_head

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        self.model.gradient_checkpointing_enable(**kwargs)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Token ids [B, T] on the first stage, hidden states [B, T, H] on the others;
        returns hidden states, or logits [B, T, vocab] on the last stage."""
        hidden = self.model.embed_tokens(inputs) if self.is_first else inputs
        positions = self.positions if self.positions is not None \
            else torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        attention = self._attention_inputs(hidden, positions)
        rotary = self.model.rotary_emb(hidden, positions)
        layer_types = getattr(self.config, "layer_types", None)
        moe = {"moe_token_mask": self.token_masks[self.forwards]} if self.token_masks else {}
        if self.routings:
            moe["moe_routing"] = self.routings[self.forwards]
        self.forwards += 1
        for i in self.layers:
            kind = layer_types[i] if layer_types else "full_attention"
            hidden = self.model.layers[i](hidden, position_embeddings=rotary, position_ids=positions, use_cache=False,
                                          **attention[kind], **moe)
        if not self.is_last:
            return hidden
        logits = self.lm_head(self.model.norm(hidden))
        # gathered from an uneven vocabulary split, logits are a view into a padded buffer; pipelining
        # (torch 2.11) refuses outputs whose strides differ from those it inferred
        return logits if isinstance(logits, DTensor) else logits.contiguous()

    def _attention_inputs(self, hidden: torch.Tensor, positions: torch.Tensor) -> dict[str, dict]:
        """Each kind of layer's attention arguments, as long as `positions`. A sliding-window model
        attending by spans: each row a span, each layer within its own window
        (`rlsys.parallel.span_attention`; under context parallel Ulysses' attention makes the spans
        over the gathered rows), where transformers would build a mask of the row's width for every
        sliding layer. Else HF's own causal masks (None where its attention kernel is causal by
        itself; HF reads only the shape and dtype of `inputs_embeds`)."""
        if has_sliding_window(self.config) and uses_span_attention(self):
            by_spans = {"attention_mask": None}
            if self.config._attn_implementation != ULYSSES:
                by_spans["shared_spans"] = SharedPrefixSpans.of_whole_rows(hidden.shape[0], positions.shape[1],
                                                                          hidden.device)
            return {"full_attention": by_spans, "sliding_attention": by_spans}
        queries = hidden[:, :1].expand(-1, positions.shape[1], -1)
        kwargs = dict(config=self.config, inputs_embeds=queries, attention_mask=None, past_key_values=None,
                      position_ids=positions)
        masks = {"full_attention": {"attention_mask": create_causal_mask(**kwargs)}}
        if "sliding_attention" in (getattr(self.config, "layer_types", None) or ()):
            masks["sliding_attention"] = {"attention_mask": create_sliding_window_causal_mask(**kwargs)}
        return masks


def split_into_stages(build_model, pp: int, pp_rank: int, stages_per_rank: int) -> list[DecoderStage]:
    """This rank's stages, each cut from its own fresh (meta-device) model from `build_model()`."""
    num_stages = pp * stages_per_rank
    stages = []
    for index in rank_stage_indices(pp_rank, pp, stages_per_rank):
        model = build_model()
        layers = stage_layers(model.config.num_hidden_layers, num_stages)[index]
        stages.append(DecoderStage(model, layers, index, num_stages))
        log.info("pipeline stage %d of %d: layers %d-%d", index, num_stages, layers.start, layers.stop - 1)
    return stages
