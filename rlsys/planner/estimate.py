"""One small model of a training step's memory and traffic on one rank, for a layout.

Memory: the states the rank keeps (parameters, gradients, AdamW's two moments, as FSDP2
shards them: `shards.rank_shards`; a reference policy's parameters; a critic's states), the
weights FSDP2 gathers for the unit it runs, the activations a micro-batch saves for backward
(every block's, or with activation checkpointing each block's input plus one block's), and a
colocated rollout engine's weights and KV cache while it generates. With `parallel.offload` the
states live in host memory instead, and only the units FSDP2 gathers come to the GPU. Traffic: the
bytes each collective sends per step from one rank, and whether its group spans nodes (ranks fill a
node in the mesh's row-major order, tp innermost); with offload, the shards copied to the GPU and
the gradients copied back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import torch

from rlsys.config.layout import ParallelConfig
from rlsys.data.batching import token_budget_sizes
from rlsys.models.moe import num_experts
from rlsys.parallel.dims import MESH_DIMS, ParallelDims
from rlsys.parallel.parallelize import needs_fsdp
from rlsys.parallel.pipeline_stages import stages_per_rank
from rlsys.planner.shards import ModelShapes, RankShards, rank_shards

FP32 = 4


@dataclass(frozen=True)
class Workload:
    """What one training step asks of the training group."""

    sequences: int
    """Sequences trained on per step (an RL step: prompts x samples)."""
    seq_len: int
    """Tokens of the longest sequence (prompt + response)."""
    micro_batch_rows: int
    """Rows of a micro-batch (`train.micro_batch_size`), unless a token budget is set."""
    micro_batch_tokens: int | None = None
    """The token budget of a micro-batch on one rank (`train.micro_batch_tokens`; under context
    parallel a micro-batch holds cp times as many tokens of whole sequences)."""
    update_passes: int = 1
    """Forward + backward passes over the batch per step (PPO epochs)."""
    forward_passes: int = 0
    """Forward-only passes (old log-probs, the reference's, the critic's values)."""
    reference: bool = False
    critic: bool = False
    engine_gib: float = 0.0
    """A colocated rollout engine's KV cache per GPU (its weights are added from the model)."""
    engine_tp: int = 1
    engine_released: bool = True
    """The engine frees its weights and KV cache while the trainer updates (vLLM sleep mode)."""
    lora_rank: int = 0
    """LoRA adapters of this rank on every linear layer of the blocks: only they have gradients and
    optimizer state, and the reference is the base model (no copy)."""


@dataclass(frozen=True)
class Precision:
    param_bytes: int = FP32
    """The parameters, their gradients and AdamW's moments (rlsys keeps fp32 masters)."""
    compute_bytes: int = 2
    """Activations and FSDP2's gathered weights (bf16 under mixed precision)."""
    mixed: bool = True
    """FSDP2 casts to the compute dtype (`parallel.mixed_precision` on a GPU)."""
    engine_bytes: int = 2


@dataclass(frozen=True)
class Layout:
    """A candidate `parallel:` section."""

    parallel: ParallelConfig

    @cached_property
    def dims(self) -> ParallelDims:
        return ParallelDims.of(self.parallel)

    @property
    def activation_checkpointing(self) -> bool:
        return self.parallel.activation_checkpointing

    @property
    def offload(self) -> bool:
        return self.parallel.offload

    @property
    def sequence_parallel(self) -> bool:
        return self.parallel.sequence_parallel

    @property
    def stages_per_rank(self) -> int:
        return stages_per_rank(self.parallel)

    @property
    def name(self) -> str:
        parts = [f"{key}{getattr(self.dims, key)}" for key in (*MESH_DIMS, "ep") if getattr(self.dims, key) > 1]
        if self.dims.tp > 1:  # the planner's tp layouts have both; say when one is off
            parts += [f"-{short}" for short, key in (("sp", "sequence_parallel"), ("lp", "loss_parallel"))
                      if not getattr(self.parallel, key)]
        return (" ".join(parts or ["1 rank"]) + (" +ac" if self.activation_checkpointing else "")
                + (" +offload" if self.offload else ""))


def layout_of(**keys) -> Layout:
    """A layout from `parallel:` keys (degrees, activation_checkpointing, ...)."""
    return Layout(ParallelConfig(**keys))


@dataclass
class RankMemory:
    """Bytes one rank holds at its peak."""

    params: int
    grads: int
    optim: int
    reference: int = 0
    critic: int = 0
    gathered: int = 0
    activations: int = 0
    engine: int = 0
    offloaded: bool = False
    """The states live in host memory (`parallel.offload`), not on the GPU."""

    @property
    def held(self) -> int:
        """The states, wherever they live: parameters, gradients, optimizer, reference, critic."""
        return self.params + self.grads + self.optim + self.reference + self.critic

    @property
    def states(self) -> int:
        """The states on the GPU."""
        return 0 if self.offloaded else self.held

    @property
    def host(self) -> int:
        """The states in host memory."""
        return self.held if self.offloaded else 0

    @property
    def update_peak(self) -> int:
        return self.states + self.gathered + self.activations

    def peak(self, engine_released: bool) -> int:
        """The larger of the update's peak and the rollout's (states without gradients, plus the engine)."""
        rollout = self.states - (0 if self.offloaded else self.grads) + self.engine
        return max(self.update_peak + (0 if engine_released else self.engine), rollout)


@dataclass
class Traffic:
    """Bytes one rank sends per step, by collective, within a node and across nodes."""

    intra: dict[str, float] = field(default_factory=dict)
    inter: dict[str, float] = field(default_factory=dict)

    def add(self, what: str, nbytes: float, across_nodes: bool) -> None:
        if nbytes > 0:
            side = self.inter if across_nodes else self.intra
            side[what] = side.get(what, 0.0) + nbytes

    @property
    def intra_bytes(self) -> float:
        return sum(self.intra.values())

    @property
    def inter_bytes(self) -> float:
        return sum(self.inter.values())


class ModelDims:
    """The sizes of an HF config the activation and traffic model needs."""

    def __init__(self, config):
        self.hidden = config.hidden_size
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or self.hidden // self.heads
        self.intermediate = config.intermediate_size
        self.vocab = config.vocab_size
        self.layers = config.num_hidden_layers
        self.experts = num_experts(config)
        self.top_k = getattr(config, "num_experts_per_tok", 0) or 0
        self.expert_intermediate = getattr(config, "moe_intermediate_size", None) or self.intermediate


def fsdp_wraps(layout: Layout, precision: Precision) -> bool:
    """Whether FSDP2 wraps the model (`parallelize.needs_fsdp`)."""
    dims = layout.dims
    return needs_fsdp(dims.dp_replicate * dims.dp_shard * dims.cp, torch.bfloat16 if precision.mixed else None,
                      dims.tp, dims.ep, layout.offload)


def rank_memory(shapes: ModelShapes, layout: Layout, work: Workload, precision: Precision, rank: int,
                critic_shapes: ModelShapes | None = None) -> RankMemory:
    dims, fsdp = layout.dims, fsdp_wraps(layout, precision)
    held = rank_shards(shapes, dims, rank, layout.stages_per_rank, fsdp)
    whole = rank_shards(shapes, dims, rank, layout.stages_per_rank, fsdp=False) if fsdp else held
    p = precision.param_bytes
    memory = RankMemory(params=held.elements * p, grads=held.elements * p, optim=2 * held.elements * p,
                        offloaded=layout.offload)
    if work.lora_rank:
        adapters = adapter_elements(shapes, layout, held, work.lora_rank)
        memory.params += adapters * FP32
        memory.grads, memory.optim = adapters * FP32, 2 * adapters * FP32
    elif work.reference:
        memory.reference = held.elements * p
    if work.critic and critic_shapes is not None:
        memory.critic = 4 * rank_shards(critic_shapes, dims, rank, layout.stages_per_rank, fsdp).elements * p
    model = ModelDims(shapes.config)
    logits = logit_bytes(model, layout, work, held)
    memory.activations = activation_bytes(model, layout, work, precision, held) + logits
    memory.gathered = _gathered(shapes, layout, whole, precision, logits) if fsdp else 0
    if work.engine_gib:
        memory.engine = shapes.total * precision.engine_bytes // work.engine_tp + int(work.engine_gib * 2**30)
    return memory


def adapter_elements(shapes: ModelShapes, layout: Layout, held: RankShards, rank: int) -> int:
    """A rank's share of LoRA adapters (rank x (inputs + outputs) for each linear weight of its
    blocks), split as its blocks' weights are (tp, FSDP): about rank / hidden of the blocks."""
    dims = layout.dims
    total = sum(rank * sum(p.shape) for p in shapes.params
                if p.layer in held.layers and len(p.shape) == 2 and not p.expert)
    return int(total / (dims.tp * dims.dp_shard * dims.cp))


def _gathered(shapes: ModelShapes, layout: Layout, whole: RankShards, precision: Precision,
              logits: float) -> int:
    """FSDP2's unsharded weights and gradients, in the compute dtype, at the step's peak. That is
    the loss's backward, where the root's weights are gathered (the embedding, final norm and LM
    head: FSDP2 keeps the root gathered from forward to backward; the whole model when one rank's
    root is the only unit, the whole stage when a pipeline keeps it gathered) and no gradient exists
    yet; unless the `logits` bytes freed after it outweigh what the first block's backward gathers:
    that block and the next (prefetched), its gradients and the root's (an untied input embedding
    has none yet: the backward reaches it last, when the blocks' activations are gone)."""
    dims, b = layout.dims, precision.compute_bytes
    if dims.pp > 1 or (dims.dp_replicate * dims.dp_shard * dims.cp == 1 and not layout.offload):
        return int(whole.elements * b)  # one unit, or a stage kept gathered: its gradients come as activations go
    outside = _outside_blocks(shapes, dims.tp)
    block = (whole.elements - outside) / max(1, len(whole.layers))
    root_grads = outside - (0 if shapes.tied else _input_embedding(shapes, dims.tp))
    first_backward = (2 * block + block + root_grads) * b
    return int(outside * b + max(0.0, first_backward - logits))


def _input_embedding(shapes: ModelShapes, tp: int) -> float:
    """Elements of the input embedding a rank holds before FSDP2."""
    return sum(math.prod(p.shape) / (tp if p.tp_dim is not None else 1) for p in shapes.params
               if p.name.endswith("embed_tokens.weight"))


def _outside_blocks(shapes: ModelShapes, tp: int) -> float:
    """Elements of the embedding, final norm and LM head a rank holds before FSDP2."""
    return sum(math.prod(p.shape) / (tp if p.tp_dim is not None else 1) for p in shapes.params if p.layer is None)


def micro_batches(layout: Layout, work: Workload) -> tuple[int, int]:
    """(micro-batches per step on a rank, tokens each puts on a rank), cut as a rank's model
    cuts a data-parallel shard (`RankModel._micro_batches`, `_pipeline_micro_batches`)."""
    dims, parallel = layout.dims, layout.parallel
    rows = max(1, math.ceil(work.sequences / dims.dp_size))
    if work.micro_batch_tokens:
        sizes = token_budget_sizes([work.seq_len] * rows, work.micro_batch_tokens * dims.cp)
    else:
        sizes = [len(part) for part in _cut(rows, work.micro_batch_rows)]
    count = len(sizes)
    if dims.pp > 1:
        count = max(count, parallel.pp_microbatches) if work.micro_batch_tokens else parallel.pp_microbatches
        if parallel.pp_schedule == "interleaved_1f1b":
            count = -(-count // dims.pp) * dims.pp
        sizes = [math.ceil(rows / count)]
    return count, math.ceil(max(sizes) * work.seq_len / dims.cp)


def _cut(rows: int, per_micro_batch: int) -> list[range]:
    return [range(start, min(rows, start + per_micro_batch)) for start in range(0, rows, per_micro_batch)]


def layer_activation_bytes(model: ModelDims, tp: int, sequence_parallel: bool, compute: int) -> float:
    """Bytes one decoder block saves for backward per token on a rank: the norms' fp32 copies
    (split by tp under sequence parallel), attention's input, its rotated q and k, v and its
    output (the rotary multiplications save cos and sin, not q and k), and the MLP's input, gate,
    up, activation and product (an MoE block: its top-k experts')."""
    h, q = model.hidden, model.heads * model.head_dim / tp
    kv = model.kv_heads * model.head_dim / tp
    norms = 2 * 2 * h * FP32 / (tp if sequence_parallel else 1)
    attention = compute * (h + (q + 2 * kv) + q)
    if model.experts:
        mlp = compute * (h + model.top_k * (3 * h + 4 * model.expert_intermediate)) / tp + FP32 * model.experts
    else:
        mlp = compute * (h + 4 * model.intermediate / tp)
    return norms + attention + mlp


def activation_bytes(model: ModelDims, layout: Layout, work: Workload, precision: Precision,
                     held: RankShards) -> int:
    """Activations one rank's blocks hold at the end of its micro-batches' forward (for as many
    micro-batches as its pipeline stage keeps in flight)."""
    dims, b = layout.dims, precision.compute_bytes
    _, tokens = micro_batches(layout, work)
    per_layer = layer_activation_bytes(model, dims.tp, layout.sequence_parallel, b)
    layers = len(held.layers)
    if layout.activation_checkpointing:
        block_inputs = layers * tokens * model.hidden * b / (dims.tp if layout.sequence_parallel else 1)
        blocks = block_inputs + tokens * per_layer
    else:
        blocks = layers * tokens * per_layer
    return int(blocks * _in_flight(layout, work))


def _in_flight(layout: Layout, work: Workload) -> int:
    """Micro-batches whose activations a pipeline stage holds at once."""
    if layout.dims.pp == 1:
        return 1
    count, _ = micro_batches(layout, work)
    if layout.parallel.pp_schedule == "gpipe":
        return count
    return min(count, layout.dims.pp * layout.stages_per_rank)


LOSS_BACKWARD_COPIES = 3
"""fp32 logit-sized tensors alive in the loss's backward: the fp32 logits it saved, their gradient
and a temporary; the compute-dtype logits are gone by then."""


def logit_bytes(model: ModelDims, layout: Layout, work: Workload, held: RankShards) -> int:
    """The loss's backward on the last stage: fp32 logit-sized tensors of a micro-batch, split over
    tp only under loss parallel (otherwise each tp rank holds the whole vocabulary)."""
    if not (held.last_stage or layout.dims.pp == 1):
        return 0
    _, tokens = micro_batches(layout, work)
    vocab_split = layout.dims.tp if layout.parallel.loss_parallel else 1
    return int(tokens * model.vocab / vocab_split * LOSS_BACKWARD_COPIES * FP32)


def spans_nodes(stride: int, size: int, gpus_per_node: int) -> bool:
    """Whether some group of `size` ranks `stride` apart reaches beyond one node: the groups
    tile blocks of stride x size consecutive ranks, which stay within nodes only when a node
    holds whole blocks."""
    span = stride * size
    return size > 1 and (span > gpus_per_node or gpus_per_node % span != 0)


def traffic(shapes: ModelShapes, layout: Layout, work: Workload, precision: Precision,
            gpus_per_node: int) -> Traffic:
    """Bytes rank 0 (the first stage's) sends per step in each collective, ring algorithms' counts:
    an all-gather or reduce-scatter of n bytes over g ranks sends n (g - 1) / g, an all-reduce twice
    that, an all-to-all (g - 1) / g of what it holds."""
    dims, model, out = layout.dims, ModelDims(shapes.config), Traffic()
    fsdp = fsdp_wraps(layout, precision)
    whole = rank_shards(shapes, dims, 0, layout.stages_per_rank, fsdp=False)
    count, tokens = micro_batches(layout, work)
    forwards = count * (work.update_passes + work.forward_passes)
    backwards = count * work.update_passes
    # FSDP2 gathers and reduces per micro-batch; a pipeline schedule keeps its stage gathered and
    # reduces once, after its last micro-batch
    schedules = 1 if dims.pp > 1 else count
    fsdp_gathers = schedules * (work.update_passes + work.forward_passes) + (backwards if dims.pp == 1 else 0)
    fsdp_reduces = schedules * work.update_passes
    b, node = precision.compute_bytes, gpus_per_node
    # ranks between neighbours of each group: the product of the degrees inside it in the mesh
    stride = {"tp": 1, "cp": dims.tp, "dp_shard_cp": dims.tp, "dp_replicate": dims.dp_shard * dims.cp * dims.tp,
             "pp": dims.ranks_per_stage}
    shard_group = dims.dp_shard * dims.cp
    dense, experts = whole.elements - whole.expert_elements, whole.expert_elements
    if fsdp and shard_group > 1:
        part = (shard_group - 1) / shard_group
        across = spans_nodes(stride["dp_shard_cp"], shard_group, node)
        out.add("fsdp all-gather", fsdp_gathers * dense * b * part, across)
        out.add("fsdp reduce-scatter", fsdp_reduces * dense * FP32 * part, across)
    if fsdp and dims.efsdp > 1 and experts:
        part = (dims.efsdp - 1) / dims.efsdp
        across = spans_nodes(dims.ep, dims.efsdp, node)
        out.add("expert fsdp all-gather", fsdp_gathers * experts * b * part, across)
        out.add("expert fsdp reduce-scatter", fsdp_reduces * experts * FP32 * part, across)
    if layout.offload:  # every gather copies the unit's shards in; every reduction its gradients out
        held = rank_shards(shapes, dims, 0, layout.stages_per_rank, fsdp=True).elements
        out.add("offload host-to-device", fsdp_gathers * held * precision.param_bytes, False)
        out.add("offload device-to-host", fsdp_reduces * held * FP32, False)
    if dims.dp_replicate > 1:
        shard = (dense / shard_group + experts / max(1, dims.efsdp)) * FP32
        part = 2 * (dims.dp_replicate - 1) / dims.dp_replicate
        across = spans_nodes(stride["dp_replicate"], dims.dp_replicate, node)
        out.add("hsdp all-reduce", fsdp_reduces * shard * part, across)
    layers = len(whole.layers)
    activation = tokens * model.hidden * b
    # activations' collectives run again when checkpointed blocks recompute their forward
    passes = forwards + backwards * (2 if layout.activation_checkpointing else 1)
    if dims.tp > 1:  # sequence parallel: an all-gather into and a reduce-scatter out of attention and a dense MLP
        per_layer = 2 if model.experts else 4  # an MoE block runs on its rank's share of the sequence
        sent = passes * (layers * per_layer + 2) * activation * (dims.tp - 1) / dims.tp
        out.add("tp all-gather/reduce-scatter", sent, spans_nodes(stride["tp"], dims.tp, node))
    if dims.pp > 1:
        out.add("pp send/recv", (forwards + backwards) * activation, spans_nodes(stride["pp"], dims.pp, node))
    if dims.cp > 1:
        heads = (2 * model.heads + 2 * model.kv_heads) * model.head_dim / dims.tp
        out.add("cp all-to-all", passes * layers * tokens * heads * b * (dims.cp - 1) / dims.cp,
                spans_nodes(stride["cp"], dims.cp, node))
    if dims.ep > 1 and model.experts:
        routed = tokens / dims.tp * model.top_k * model.hidden * b
        out.add("ep all-to-all", passes * layers * 2 * routed * (dims.ep - 1) / dims.ep,
                spans_nodes(1, dims.ep, node))
    return out


@dataclass(frozen=True)
class Speeds:
    """What the step-time model assumes of the hardware (an H100 node with InfiniBand)."""

    tflops: float = 400.0
    """Sustained bf16 TFLOP/s of one GPU (about 40% of an H100's dense peak)."""
    intra_gbps: float = 150.0
    """GB/s one GPU's collectives reach within a node (NVLink, ring algorithms)."""
    inter_gbps: float = 40.0
    """GB/s one GPU's collectives reach across nodes (a 400 Gb/s NIC per GPU)."""
    pcie_gbps: float = 25.0
    """GB/s between one GPU and host memory, each way (PCIe Gen5 x16 in practice, pinned memory)."""
    host_gbps: float = 20.0
    """GB/s of host memory bandwidth one rank's optimizer step gets (a node's ~200 GB/s over 8 ranks)."""


OVERLAPPED = ("fsdp", "expert fsdp", "hsdp", "offload")
"""Copies FSDP2 prefetches while the previous block computes; the rest wait on their inputs."""

ADAMW_BYTES = 7 * FP32
"""Bytes an AdamW step moves per fp32 parameter: it reads the parameter, its gradient and the two
moments, and writes the parameter and the moments."""


@dataclass(frozen=True)
class StepTime:
    compute: float
    bubble: float
    exposed: float
    """Communication not hidden behind compute."""
    host_optimizer: float = 0.0
    """The optimizer step on the host, with offload (on the GPU it is too short to count)."""

    @property
    def total(self) -> float:
        return self.compute + self.bubble + self.exposed + self.host_optimizer


def step_time(shapes: ModelShapes, layout: Layout, work: Workload, moved: Traffic, speeds: Speeds) -> StepTime:
    """Seconds of one training step on a rank: the matmul FLOPs of every pass (6 per parameter
    and token for forward + backward, 2 for a forward, 2 more where a block recomputes; experts
    counted for the top-k a token uses; causal attention's), an even share per GPU; the pipeline's
    1F1B bubble; the communication compute cannot hide; with offload, AdamW on the host."""
    model, dims = ModelDims(shapes.config), layout.dims
    active = shapes.total - shapes.expert_total * (1 - model.top_k / model.experts if model.experts else 0)
    attention = model.layers * work.seq_len * model.heads * model.head_dim  # per token, forward, causal
    per_token_forward = 2 * active + 2 * attention
    recomputed = work.update_passes if layout.activation_checkpointing else 0
    passes = 3 * work.update_passes + work.forward_passes + recomputed
    flops = passes * per_token_forward * work.sequences * work.seq_len / dims.world_size
    compute = flops / (speeds.tflops * 1e12)
    count, _ = micro_batches(layout, work)
    bubble = compute * (dims.pp - 1) / count if dims.pp > 1 else 0.0
    hidden, exposed = 0.0, 0.0
    for side, gbps in ((moved.intra, speeds.intra_gbps), (moved.inter, speeds.inter_gbps)):
        for what, nbytes in side.items():
            seconds = nbytes / ((speeds.pcie_gbps if what.startswith("offload") else gbps) * 1e9)
            if what.startswith(OVERLAPPED):
                hidden += seconds
            else:
                exposed += seconds
    host = 0.0
    if layout.offload:
        held = rank_shards(shapes, dims, 0, layout.stages_per_rank, fsdp=True).elements
        host = held * ADAMW_BYTES / (speeds.host_gbps * 1e9)
    return StepTime(compute, bubble, exposed + max(0.0, hidden - compute), host)
