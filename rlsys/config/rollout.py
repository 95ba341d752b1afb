"""Generation sections: the rollout engines, the tools their agent loops call, and evaluation.

Each field carries its documentation as an attribute docstring; docs/configuration.md's key tables
are generated from them (`python -m rlsys.config.docs`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field
from pydantic.dataclasses import dataclass

from rlsys.config.base import STRICT


@dataclass(config=STRICT)
class ToolsConfig:
    """Tools the agent loops call (`rollout.agent_loop: tool`), and the limits of their use."""

    names: list[str] = Field(default_factory=list)
    """Registered tools (calculator, python) or `path/to/file.py:Name` (a function or a BaseTool subclass)."""
    config_file: str = ""
    """A tool YAML in VeRL's format (tools: - class_name, config, tool_schema)."""
    parser: str = "hermes"
    """How tool calls are written in a sampled turn: hermes (<tool_call>{json}</tool_call>, Qwen's format)."""
    max_turns: int = Field(default=4, gt=0)
    """Model turns per trajectory."""
    max_calls: int = Field(default=8, gt=0)
    """Tool calls per trajectory; later ones are answered with an error."""
    max_response_tokens: int = Field(default=128, gt=0)
    """Tokens of one tool result the model sees; longer ones are cut."""
    timeout_s: float = Field(default=10.0, gt=0)
    """Time for one call; past it the model sees an error."""
    num_workers: int = Field(default=2, gt=0)
    """Tool worker actors; each runs every tool, many calls at once."""
    sandbox: dict[str, Any] = Field(default_factory=dict)
    """The `python` tool's sandbox when it is named in `names`: SandboxLimits' fields (wall_s, cpu_s, memory_mb,
    processes, cpus, disk_mb, file_mb, open_files, stack_mb) and allow_weaker (run where this machine cannot give every
    layer of isolation; otherwise the stage refuses to start, naming the missing layer). A tool YAML's `config`
    sets them per tool."""


@dataclass(config=STRICT)
class EvalConfig:
    files: list[str] = Field(default_factory=list)
    """Test split in the RL schema (data_source, prompt, reward_model.ground_truth)."""
    reward: str = ""
    """Reward that judges each response (1 = correct; required): a registered name, or `path/to/file.py[:function]`
    (a file or package directory with VeRL's compute_score signature)."""
    max_new_tokens: int = Field(default=16, gt=0)
    """Generation budget per prompt (per model turn of a multi-turn loop)."""
    max_response_tokens: int | None = Field(default=None, gt=0)
    """Tokens of a whole response with a multi-turn loop (empty: max_new_tokens; in RL validation,
    rollout.max_response_tokens)."""
    temperature: float = Field(default=0.0, ge=0, le=2)
    """Sampling temperature (0 is greedy; vLLM takes at most 2)."""
    limit: int = Field(default=0, ge=0)
    """Evaluate only the first N rows (0: all)."""
    agent_loop: str | None = None
    """The agent loop that answers each prompt (single_turn, tool, openai, or path/to/file.py:ClassName); empty:
    rollout.agent_loop in RL validation, single_turn elsewhere."""
    agent_entry: str = ""
    """The openai loop's harness in the eval stage (path/to/file.py:function); RL validation runs
    rollout.agent_entry."""
    agent_timeout_s: float = Field(default=600.0, gt=0)
    """Time for one run of the eval stage's harness."""
    engine_memory_gib: float = Field(default=0.5, gt=0)
    """KV-cache memory for the vLLM engine, in GiB."""


@dataclass(config=STRICT)
class ServingConfig:
    """vLLM engines serving a frozen model beside the policy (a reward model, a judge, a distillation
    teacher): started with the run when a config names the model, called every step, shut down with it."""

    placement: Literal["colocated", "separate"] = "colocated"
    """colocated: the engines sit in the training ranks' bundles, sharing their devices and reserving no
    CPUs (they keep their memory through the update); separate: a placement group of their own."""
    num_engines: int = Field(default=1, gt=0)
    """Engines; each step's requests are split across them."""
    tensor_parallel_size: int = Field(default=1, gt=0)
    """Tensor-parallel size of each engine."""
    cpus_per_engine: float = Field(default=1.0, ge=0)
    """CPUs reserved per engine with placement=separate."""
    gpus_per_engine: float | None = Field(default=None, ge=0)
    """GPUs per engine rank with placement=separate (each rank of a tensor-parallel engine takes this many).
    Empty: 1 on a cluster with GPUs, beside those of the training ranks; 0 (CPU) on one without."""
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Weights and compute: auto is bfloat16 on GPU, float32 on CPU."""
    engine_memory_gib: float = Field(default=0.5, gt=0)
    """KV-cache memory per engine, in GiB."""
    max_model_len: int | None = Field(default=None, gt=0)
    """Longest sequence an engine takes; empty: a teacher's engines take the rollout engines' (the run's longest
    prompt plus the response budget), a reward model's or a judge's the model's context. Its KV cache must hold
    one such sequence (checked before the run starts)."""
    timeout_s: float = Field(default=3600.0, gt=0)
    """A call to an engine (its share of a step's scoring) running longer than this is a hung engine:
    killed and replaced as a dead one is (`train.max_worker_restarts`)."""


CPU_ENGINE_MEMORY_GIB = 0.5
"""A rollout engine's KV cache on CPU when rollout.engine_memory_gib is empty."""


@dataclass(config=STRICT)
class RolloutConfig:
    num_engines: int | None = Field(default=None, gt=0)
    """vLLM engines; the prompt batch is split across them (data parallel). Empty: colocated on training
    ranks that have GPUs, one engine per rollout.tensor_parallel_size of them (every GPU generates, as
    VeRL's rollout data parallelism); otherwise 1."""
    tensor_parallel_size: int = Field(default=1, gt=0)
    """Tensor-parallel size of each engine (on CPU its ranks are worker processes, each bound to its share of
    the engine's cores)."""
    placement: Literal["colocated", "separate"] = "colocated"
    """colocated: engines share the training ranks' devices; separate: their own placement group."""
    free_memory_in_update: bool = True
    """Colocated engines free their weights and KV cache after generating, while the trainer runs (vLLM sleep
    mode level 2 on GPU; on CPU the weights' storages shrink and the KV cache stays), and take them back for the
    sync and the next rollout."""
    cpus_per_engine: float = Field(default=1.0, ge=0)
    """CPUs reserved per engine with placement=separate."""
    gpus_per_engine: float | None = Field(default=None, ge=0)
    """GPUs per engine rank with placement=separate (each rank of a tensor-parallel engine takes this many).
    Empty: 1 on a cluster with GPUs, beside those of the training ranks; 0 (CPU) on one without."""
    n: int = Field(default=4, gt=0)
    """Responses sampled per prompt (the GRPO group size)."""
    temperature: float = Field(default=1.0, ge=0, le=2)
    """Sampling temperature (vLLM takes at most 2)."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling threshold."""
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """The engine's weights and compute: auto is bfloat16 on GPU (as the trainer's mixed precision computes),
    float32 on CPU."""
    max_new_tokens: int = Field(default=16, gt=0)
    """Generation budget per model turn (per response with the single_turn loop)."""
    max_response_tokens: int | None = Field(default=None, gt=0)
    """Tokens of a whole response: the model's turns and the tool turns between them (empty: max_new_tokens).
    Also the horizon of the seq-mean-token-sum-norm aggregation."""
    agent_loop: str = "single_turn"
    """How a prompt becomes a trajectory: single_turn (one response), tool (calls `tools`, reads their
    results, goes on), openai (the agent harness `agent_entry`, through an OpenAI-compatible endpoint), or
    path/to/file.py:ClassName (an AgentLoop subclass)."""
    agent_entry: str = ""
    """The openai loop's harness: path/to/file.py:function, an `async def run(client: openai.AsyncOpenAI,
    row: dict) -> str or dict` (row: the data row's prompt, data_source, extra_info)."""
    agent_timeout_s: float = Field(default=600.0, gt=0)
    """Time for one run of the openai loop's harness; past it the sample is dropped and counted."""
    context_hook: str = ""
    """The tool loop's history before each model turn after the first: path/to/file.py:function, a
    `hook(messages, tokenizer) -> messages` given the conversation as OpenAI messages, or the built-in
    drop_tool_outputs (the oldest tool outputs replaced by a note until it fits context_budget tokens). A
    rewritten history becomes the prompt of a new segment of the episode (train_segments)."""
    context_budget: int = Field(default=1024, gt=0)
    """Tokens drop_tool_outputs keeps the conversation within (it always keeps the newest tool output)."""
    train_segments: Literal["all", "last"] = "all"
    """The segments of an episode trained on: all (each a row of the batch with the episode's advantage; the
    group baseline counts episodes), or the last alone. An agent that rewrites its history (a harness's
    summary, `context_hook`) starts a new segment at each rewrite."""
    stop: list[str] = Field(default_factory=list)
    """Extra stop strings (the tokenizer's EOS always stops). As in VeRL, the reward sees the response's tokens
    decoded, so the text ends with the stop string: the tokens trained on."""
    engine_memory_gib: float | None = Field(default=None, gt=0)
    """KV-cache memory per engine, in GiB. It must hold one sequence of max_model_len tokens (checked before
    the run starts). Empty: 0.5 on CPU; on a GPU, what rollout.gpu_memory_utilization leaves of the device
    after the engine's weights and activations."""
    gpu_memory_utilization: float = Field(default=0.5, gt=0, le=0.95)
    """On a GPU with engine_memory_gib empty: the share of the device's memory an engine takes for its
    weights, activations and KV cache (vLLM's gpu_memory_utilization; VeRL's default), at most what is free
    when it starts. A colocated engine gives it back while the trainer updates (free_memory_in_update), so
    the trainer's held states and this share must fit the device together."""
    max_model_len: int | None = Field(default=None, gt=0)
    """Longest sequence an engine takes; empty: the run's longest prompt (training and validation) plus a whole
    response's budget, as VeRL sets it (the model's context for the openai loop, whose harness writes the
    requests, and for a loop of your own). Set, it must hold that sequence (checked before the run starts)."""
    block_size: int | None = Field(default=None, gt=0)
    """KV-cache block size in tokens (empty: vLLM's default, 128 on CPU). The prefix cache reuses whole
    blocks only, so a multi-turn loop continues from its cached turns with smaller blocks (a multiple of 32
    on CPU)."""
    max_num_seqs: int | None = Field(default=None, gt=0)
    """Sequences an engine runs at once; empty: vLLM's default for the device (256 on CPU)."""
    max_num_batched_tokens: int | None = Field(default=None, gt=0)
    """Tokens an engine computes in one forward pass; empty: vLLM's default. On CPU prompts are never split
    across passes (vLLM cannot rewind a seeded CPU sampler after a partial prefill), so there it must be at
    least the model's context length, which is also what empty gives."""
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    """More of vLLM's engine arguments (`vllm.LLM(**engine_kwargs)`, VeRL's `rollout.engine_kwargs.vllm`), e.g.
    `{attention_backend: TRITON_ATTN}`; they override what rlsys sets. An unknown name fails the engine's start."""
    sync_bucket_mb: float = Field(default=64.0, gt=0)
    """Weight-sync bucket size: decoder blocks are gathered and sent this many MB at a time."""
    timeout_s: float = Field(default=3600.0, gt=0)
    """A call to an engine (its share of a step's generation, a memory release, a weight sync) running longer
    than this is a hung engine: killed and replaced as a dead one is (`train.max_worker_restarts`)."""
    sync_mode: Literal["auto", "shared", "gathered", "object_store"] = "auto"
    """How a sync reaches the engines. `shared`: with the engines on the training ranks' machine, each
    engine reads every rank's shards in place (on CPU from shared memory, given room in /dev/shm and a free
    file descriptor per shard; on GPU through CUDA IPC, where every engine sees every rank's GPU).
    `gathered`: the ranks gather each bucket of full tensors among themselves (in the engine's dtype), and
    each colocated engine reads it in place from the rank on its own device (CUDA IPC on a GPU, shared
    memory on CPU), as VeRL and OpenRLHF do; no engine reads another rank's memory (one pipeline stage
    only). `object_store`: each rank's shards bucket by bucket through Ray's object store. `auto`: gathered
    on GPUs, shared on CPU; the object store where those cannot run (said in a warning)."""

    @property
    def response_budget(self) -> int:
        """Tokens of a whole response (all turns)."""
        return self.max_response_tokens or self.max_new_tokens
