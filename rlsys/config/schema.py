"""Typed configuration for every stage.

Each dataclass field carries its documentation as an attribute docstring; the
key tables of docs/configuration.md are generated from them (`python -m rlsys.config.docs`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass

STRICT = ConfigDict(extra="forbid", use_attribute_docstrings=True)


@dataclass(config=STRICT)
class LoraConfig:
    rank: int = Field(default=0, ge=0)
    """LoRA rank of every adapter (peft); 0 trains every weight instead. With adapters the base model is frozen,
    the optimizer holds the adapters only, and the reference policy is the base model (adapters off)."""
    alpha: float = Field(default=16.0, gt=0)
    """Adapter scaling numerator: each adapter adds alpha / rank * B @ A to its layer."""
    dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout on each adapter's input while training."""
    target_modules: list[str] = Field(default_factory=lambda: ["all-linear"])
    """Linear layers that get an adapter, by last name (q_proj, ...); all-linear: every linear layer but the
    LM head."""
    sync: Literal["adapter", "merged"] = "adapter"
    """RL: what reaches the rollout engines after each step: the adapters alone (vLLM serves them over the base
    it loaded once), or every weight with the adapters merged in (engines without LoRA support, async modes)."""

    @property
    def syncs_adapters(self) -> bool:
        """Adapters are trained and the engines receive them alone."""
        return self.rank > 0 and self.sync == "adapter"


@dataclass(config=STRICT)
class ModelConfig:
    path: str = ""
    """Local Hugging Face causal-LM directory (config.json, safetensors, tokenizer files)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype the trainer keeps parameters in; bf16 compute on GPU comes from `parallel.mixed_precision`."""
    router_aux_loss_coef: float | None = Field(default=None, ge=0)
    """MoE models: weight of the routers' load-balancing loss in every training loss (per layer, over
    all data-parallel ranks' tokens, averaged over layers); unset takes the model config's
    `router_aux_loss_coef`, 0 turns it off."""
    lora: LoraConfig = Field(default_factory=LoraConfig)
    """LoRA adapters (rank 0: none)."""
    fp32_lm_head: bool = False
    """Compute the logits in fp32 from bf16 hidden states and weights, in the trainer and in the rollout
    engines (vLLM's `head_dtype`): removes the bf16 rounding of the logits from the engine/trainer log-prob gap
    (TRL's `cast_lm_head_to_fp32`, NeMo-RL's `fp32_lm_head`). Nothing changes where compute is already fp32."""


@dataclass(config=STRICT)
class DataConfig:
    train_files: list[str] = Field(default_factory=list)
    """JSONL or Parquet files for training, read with `datasets`."""
    max_seq_len: int = Field(default=128, gt=1)
    """Tokens per packed pretraining sequence; SFT examples longer than this are dropped and counted."""
    text_key: str = "text"
    """Pretraining: the column holding a document."""
    prompt_key: str = "prompt"
    """SFT: the prompt column (a string, or a chat list of {role, content})."""
    response_key: str = "response"
    """SFT: the response column (a string)."""
    messages_key: str = "messages"
    """SFT: a chat column used instead of prompt/response; loss falls on assistant turns."""
    tools_key: str = "tools"
    """SFT: a column of OpenAI function schemas a chat row's template renders (`tools=`), as the agent loop
    renders them into its prompts."""


@dataclass(config=STRICT)
class OptimConfig:
    lr: float = Field(default=1e-3, gt=0)
    """Peak learning rate of AdamW."""
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    """Cosine decay ends at lr * min_lr_ratio."""
    warmup_steps: int = Field(default=0, ge=0)
    """Linear warmup steps before the cosine decay."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    eps: float = Field(default=1e-8, gt=0)
    """AdamW epsilon."""
    max_grad_norm: float = Field(default=1.0, ge=0)
    """Clip the global gradient norm to this value (0 disables clipping)."""


@dataclass(config=STRICT)
class LoopConfig:
    """What every training loop has: checkpoints, resume, and what to do when a worker fails."""

    save_every: int = Field(default=0, ge=0)
    """Checkpoint period in steps (0: only at the end)."""
    keep_last: int = Field(default=2, gt=0)
    """Checkpoints kept on disk; older ones are deleted."""
    resume: bool = True
    """Resume from the newest complete checkpoint in output_dir/checkpoints when there is one."""
    max_restarts: int = Field(default=0, ge=0)
    """When a worker dies or a collective times out: rebuild the groups and resume from the newest
    checkpoint inside the same command, up to this many times (0: stop with exit code 3)."""
    collective_timeout_s: float = Field(default=600.0, gt=0)
    """A collective (all-reduce, all-gather ...) that waits longer than this, or a rank that answers
    this long after its peers, fails the step as a dead peer would."""


@dataclass(config=STRICT)
class TrainConfig(LoopConfig):
    steps: int = Field(default=100, gt=0)
    """Optimizer steps to run."""
    global_batch_size: int = Field(default=64, gt=0)
    """Sequences per optimizer step; must equal micro_batch_size x grad-accumulation x data-parallel size."""
    micro_batch_size: int = Field(default=16, gt=0)
    """Sequences per forward/backward on one rank."""
    micro_batch_tokens: int | None = Field(default=None, gt=0)
    """Tokens per forward/backward on one rank, in place of micro_batch_size (VeRL's use_dynamic_bsz
    with ppo_max_token_len_per_gpu): consecutive sequences up to this many tokens; one longer goes alone.
    Under context parallel, each rank's share of the sequences. Under pipeline parallel, the number of
    equal micro-batches each shard is split into: as many as the budget needs, at least
    parallel.pp_microbatches."""
    log_every: int = Field(default=1, gt=0)
    """Console progress-bar refresh period in steps (metrics.jsonl gets every step)."""


@dataclass(config=STRICT)
class ParallelConfig:
    """The training group's layout: world size = dp_replicate x dp_shard x tp x pp x cp ranks."""

    dp_shard: int = Field(default=1, gt=0)
    """FSDP2 shard degree (ranks that split each parameter)."""
    dp_replicate: int = Field(default=1, gt=0)
    """Replica groups of the sharded model (HSDP when both are > 1)."""
    tp: int = Field(default=1, gt=0)
    """Tensor-parallel degree: attention heads, MLP columns and the vocabulary split across this many ranks."""
    pp: int = Field(default=1, gt=0)
    """Pipeline-parallel ranks: the decoder layers split into consecutive stages."""
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"
    """With pp > 1: all forwards then all backwards (gpipe), one forward one backward (1f1b), or 1f1b
    over several smaller stages per rank (interleaved_1f1b), which shrinks the pipeline bubble."""
    pp_microbatches: int = Field(default=4, gt=0)
    """With pp > 1: micro-batches each data-parallel shard is split into (replaces train.micro_batch_size;
    with train.micro_batch_tokens, the fewest); at least pp for 1f1b; a multiple of pp for interleaved_1f1b."""
    pp_stages_per_rank: int = Field(default=2, gt=1)
    """With interleaved_1f1b: stages each pipeline rank holds (rank r runs stages r, r + pp, ...)."""
    ep: int = Field(default=1, gt=0)
    """Expert-parallel ranks: each MoE layer's experts split over this many of the dp_shard x cp x tp
    ranks, tokens sent to their experts with an all-to-all (not a dimension of the world size)."""
    cp: int = Field(default=1, gt=0)
    """Context-parallel ranks: each holds a contiguous chunk of every sequence (Ulysses all-to-all attention)."""
    sequence_parallel: bool = False
    """With tp > 1: norms and residual activations split along the sequence between the tp ranks."""
    loss_parallel: bool = False
    """With tp > 1: log-probs from the vocabulary-sharded LM head without gathering the logits."""
    activation_checkpointing: bool = False
    """Recompute each decoder block's activations in the backward pass instead of keeping them."""
    pack_sequences: bool = True
    """Lay the sequences of each micro-batch end to end in as few rows as they fit, with a
    block-causal mask, so no compute goes to padding (VeRL's use_remove_padding). Used with
    token-level losses (not GSPO, seq-mean-token-mean or sequence-level rollout_is), without
    pp or cp."""
    share_prompts: bool = True
    """With pack_sequences: rows with the same prompt (a GRPO group's samples) share one copy of it in
    the forward and backward pass where that removes at least a quarter of their tokens; the gradient
    is the same."""
    mixed_precision: Literal["auto", "none", "bf16"] = "auto"
    """FSDP2 mixed precision: auto is bf16 compute with fp32 reduction on GPU, full fp32 on CPU."""

    @property
    def world_size(self) -> int:
        """Training ranks the layout takes."""
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp


@dataclass(config=STRICT)
class RayConfig:
    cpus_per_worker: int | None = Field(default=None, gt=0)
    """CPUs reserved for each training rank (also its torch thread count). Unset: this machine's cores
    (at most ray.num_cpus) less separate rollout engines' CPUs, split evenly over the ranks; 1 when joining
    RAY_ADDRESS."""
    gpus_per_worker: float = Field(default=0.0, ge=0)
    """GPUs for each training rank; 0 trains on CPU with gloo, >0 on CUDA with nccl."""
    num_cpus: int | None = Field(default=None, gt=0)
    """Logical CPUs of a local cluster (default: this machine's cores). More than the cores lets a
    layout with more ranks than cores run, slowly; ignored when joining RAY_ADDRESS."""
    include_dashboard: bool = True
    """Start the Ray dashboard with a local cluster (ignored when joining RAY_ADDRESS)."""
    dashboard_host: str = "127.0.0.1"
    """Interface the local dashboard listens on."""


@dataclass(config=STRICT)
class TrackingConfig:
    backends: list[Literal["console", "jsonl", "wandb", "tensorboard", "mlflow", "ray"]] = Field(
        default_factory=lambda: ["console", "jsonl", "ray"]
    )
    """Where metrics go, all under the same names; metrics.jsonl is always written. `ray` exports
    them as Ray metrics `rlsys_<name>` for the dashboard and Prometheus."""
    project: str = "rlsys"
    """wandb project / mlflow experiment name."""
    run_name: str = ""
    """Run name for wandb/tensorboard (default: the output directory's name)."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """wandb mode; offline runs can be synced later with `wandb sync`."""
    mlflow_uri: str = ""
    """mlflow tracking URI (default: a local SQLite store, output_dir/mlflow.db)."""


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
    reward: str = "arith"
    """Reward that judges each response (1 = correct): a registered name, or `path/to/file.py[:function]`
    (a file or package directory with VeRL's compute_score signature)."""
    max_new_tokens: int = Field(default=16, gt=0)
    """Generation budget per prompt (per model turn of a multi-turn loop)."""
    max_response_tokens: int | None = Field(default=None, gt=0)
    """Tokens of a whole response with a multi-turn loop (empty: max_new_tokens; in RL validation,
    rollout.max_response_tokens)."""
    temperature: float = Field(default=0.0, ge=0)
    """Sampling temperature (0 is greedy)."""
    limit: int = Field(default=0, ge=0)
    """Evaluate only the first N rows (0: all)."""
    agent_loop: str | None = None
    """The agent loop that answers each prompt (single_turn, tool, or path/to/file.py:ClassName); empty:
    rollout.agent_loop in RL validation, single_turn elsewhere."""
    engine_memory_gib: float = Field(default=0.5, gt=0)
    """KV-cache memory for the vLLM engine, in GiB."""


@dataclass(config=STRICT)
class RolloutConfig:
    num_engines: int = Field(default=1, gt=0)
    """vLLM engines; the prompt batch is split across them (data parallel)."""
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
    gpus_per_engine: float = Field(default=0.0, ge=0)
    """GPUs per engine with placement=separate (0 on CPU)."""
    n: int = Field(default=4, gt=0)
    """Responses sampled per prompt (the GRPO group size)."""
    temperature: float = Field(default=1.0, ge=0)
    """Sampling temperature."""
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
    results, goes on), or path/to/file.py:ClassName (an AgentLoop subclass)."""
    stop: list[str] = Field(default_factory=list)
    """Extra stop strings (the tokenizer's EOS always stops). As in VeRL, the reward sees the response's tokens
    decoded, so the text ends with the stop string: the tokens trained on."""
    engine_memory_gib: float = Field(default=0.5, gt=0)
    """KV-cache memory per engine, in GiB."""
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
    sync_bucket_mb: float = Field(default=64.0, gt=0)
    """Weight-sync bucket size: decoder blocks are gathered and sent this many MB at a time."""
    sync_shared_memory: bool = True
    """With the engines on the training ranks' machine, they read the ranks' shards in place at every sync:
    on CPU from shared memory (given room in /dev/shm and a free file descriptor per shard), on GPU through
    CUDA IPC (where every engine sees the ranks' GPUs, as colocated engines do). False, or else: every sync
    sends the shards bucket by bucket through Ray's object store."""

    @property
    def response_budget(self) -> int:
        """Tokens of a whole response (all turns)."""
        return self.max_response_tokens or self.max_new_tokens


@dataclass(config=STRICT)
class RewardTerm:
    name: str = ""
    """A registered reward (docs/rewards.md); or leave empty and give `path`."""
    path: str = ""
    """A Python file defining the reward function (VeRL's compute_score signature works unchanged)."""
    function: str = "compute_score"
    """The function to call in `path`."""
    weight: float = 1.0
    """This term's weight in the summed reward."""
    batched: bool = False
    """The function takes lists (data_sources, solution_strs, ground_truths, extra_infos) and returns a list."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments for the function (e.g. `pattern` for regex_format)."""


@dataclass(config=STRICT)
class RewardConfig:
    terms: list[RewardTerm] = Field(default_factory=lambda: [RewardTerm(name="arith")])
    """Reward = sum of weight x score over the terms; each term is also logged as reward/<term>."""
    timeout_s: float = Field(default=10.0, gt=0)
    """Per-call time limit; a call past it scores 0 and counts in reward/errors."""
    num_workers: int = Field(default=2, gt=0)
    """Reward actors scoring in parallel, off the driver."""
    overlong_buffer_len: int = Field(default=0, ge=0)
    """DAPO's overlong shaping: a response longer than the response budget (rollout.max_response_tokens,
    else rollout.max_new_tokens) minus this many tokens loses up to overlong_penalty_factor, linearly (0: off)."""
    overlong_penalty_factor: float = Field(default=1.0, ge=0)
    """The penalty of a response that fills the whole generation budget."""


@dataclass(config=STRICT)
class KLControlConfig:
    type: Literal["fixed", "adaptive"] = "fixed"
    """fixed: the coefficient stays kl_coef; adaptive: it moves toward target_kl."""
    kl_coef: float = Field(default=0.001, ge=0)
    """The (initial) coefficient of the KL penalty in the reward."""
    target_kl: float = Field(default=0.1, gt=0)
    """adaptive: the per-token KL the coefficient steers toward."""
    horizon: int = Field(default=10000, gt=0)
    """adaptive: responses over which a 20% error changes the coefficient by 20%."""


@dataclass(config=STRICT)
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """Advantage estimator (VeRL's names): grpo (group-normalised; Dr. GRPO without
    norm_adv_by_std), rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, gae (PPO with
    a critic, see `critic`), or one registered by a file in `extensions`."""
    norm_adv_by_std: bool = True
    """grpo: divide by the group's reward std; false gives Dr. GRPO's mean-only centring."""
    gamma: float = Field(default=1.0, ge=0, le=1)
    """reinforce_plus_plus and gae: discount of the token rewards' returns."""
    lam: float = Field(default=1.0, ge=0, le=1)
    """gae: the GAE lambda (1: Monte-Carlo returns minus the values)."""
    policy_loss: str = "vanilla"
    """Policy loss: vanilla (PPO clip with dual clip), gspo (sequence-level ratio, averaged
    per sequence), or one registered by a file in `extensions`."""
    clip_ratio_low: float = Field(default=0.2, ge=0)
    """PPO clip: ratio >= 1 - clip_ratio_low."""
    clip_ratio_high: float = Field(default=0.28, ge=0)
    """PPO clip: ratio <= 1 + clip_ratio_high (DAPO's clip-higher when above the low bound)."""
    clip_ratio_c: float = Field(default=3.0, gt=1)
    """Dual clip: a negative advantage's token loss is at most -A x clip_ratio_c (VeRL's default)."""
    kl_coef: float = Field(default=0.0, ge=0)
    """KL-to-reference loss coefficient (VeRL's actor kl_loss_coef); with it and
    use_kl_in_reward both off no reference model is built."""
    kl_estimator: Literal["k1", "k2", "k3", "kl", "mse", "low_var_kl", "abs"] = "k3"
    """KL estimator: Schulman's k1, k2, k3, or VeRL's names (kl = k1, mse = k2, low_var_kl = k3
    with VeRL's clamps, which k3 also gets; abs = absolute k1)."""
    use_kl_in_reward: bool = False
    """Penalise each response token's reward by kl_ctrl's coefficient x its KL to the reference
    (estimated with kl_penalty), before the advantages."""
    kl_penalty: Literal["k1", "k2", "k3", "kl", "mse", "low_var_kl", "abs"] = "kl"
    """KL estimator of the in-reward penalty (names as kl_estimator)."""
    kl_ctrl: KLControlConfig = Field(default_factory=KLControlConfig)
    """Coefficient of the in-reward KL penalty: fixed or adaptive."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] \
        = "token-mean"
    """How per-token losses become the batch loss (seq-mean-token-sum-norm: Dr. GRPO's, each
    response's sum over rollout.max_new_tokens)."""
    filter_groups: bool = False
    """DAPO's dynamic sampling: keep only prompt groups whose reward scores differ (before the
    overlong penalty), drawing more prompts until train.prompts_per_step such groups are found."""
    max_sampling_rounds: int = Field(default=10, gt=0)
    """Dynamic sampling: prompt batches drawn per step at most; a batch still short of
    mixed groups is filled with equal-score ones and a warning (VeRL's max_num_gen_batches
    stops the run with an error instead)."""
    rollout_is: Literal["none", "token", "sequence"] = "none"
    """Truncated importance sampling against the engine's sampling log-probs: each token's
    policy loss is weighted by min(pi_old / pi_rollout, rollout_is_threshold), per token or
    one weight per response (VeRL's rollout_correction.rollout_is)."""
    rollout_is_threshold: float = Field(default=2.0, gt=1)
    """Upper bound of the rollout importance weights (VeRL's default)."""
    extensions: list[str] = Field(default_factory=list)
    """Python files or packages whose `@register_advantage` / `@register_policy_loss`
    decorators add estimators and losses to choose by name."""
    ppo_epochs: int = Field(default=1, gt=0)
    """Passes over each rollout batch."""
    ppo_mini_batch_size: int = Field(default=0, ge=0)
    """Prompts per policy update (0: the whole rollout batch, one update per epoch)."""
    old_logprobs: Literal["auto", "trainer", "rollout"] = "auto"
    """The PPO ratio's old log-probs. trainer: a forward pass over the batch before the
    update; rollout: the engine's own sampling log-probs (no extra pass); auto: none are
    needed when the update is one epoch of one mini-batch (the policy being updated is the
    one that sampled, so the loss uses its current log-probs, detached), else trainer."""

    @property
    def needs_reference(self) -> bool:
        """A KL term, in the loss or in the reward, reads a frozen reference policy."""
        return self.kl_coef > 0 or self.use_kl_in_reward


@dataclass(config=STRICT)
class CriticConfig:
    """PPO's value model (`algorithm.adv_estimator: gae`): the policy's starting model with a
    one-output value head in place of the LM head, in the same parallel layout."""

    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-5))
    """The critic's own AdamW and schedule."""
    cliprange_value: float = Field(default=0.5, gt=0)
    """Value clipping: a prediction moves at most this far from the critic's value before the update."""
    warmup_steps: int = Field(default=0, ge=0)
    """Steps that train only the critic before the policy is updated (VeRL's critic_warmup
    N gives N - 1 such steps)."""


@dataclass(config=STRICT)
class RLTrainConfig(LoopConfig):
    steps: int = Field(default=50, gt=0)
    """RL steps (one rollout batch each)."""
    prompts_per_step: int = Field(default=32, gt=0)
    """Prompts sampled per step; responses per step = prompts_per_step x rollout.n."""
    micro_batch_size: int = Field(default=16, gt=0)
    """Responses per forward/backward on one rank."""
    micro_batch_tokens: int | None = Field(default=None, gt=0)
    """Tokens (prompt and response) per forward/backward on one rank, in place of micro_batch_size
    (VeRL's use_dynamic_bsz with ppo_max_token_len_per_gpu): consecutive responses up to this many
    tokens, so a group shares its prompt; one longer goes alone. Packed sequences keep the padding out.
    Under context parallel, each rank's share of the sequences. Under pipeline parallel, the number of
    equal micro-batches each shard is split into: as many as the budget needs, at least
    parallel.pp_microbatches."""
    val_every: int = Field(default=10, ge=0)
    """Validate on `eval.files` every N steps (0: only before and after training)."""
    async_mode: Literal["off", "one_step", "full"] = "off"
    """off: generate, score, update, sync, in turn. one_step: the engines generate the next step's prompts
    while the trainer updates on this step's (VeRL's one-step off-policy). full: the engines keep
    1 + max_staleness steps of prompt groups in flight, and a step trains on the first prompts_per_step
    groups to finish. Both need rollout.placement: separate."""
    max_staleness: int = Field(default=1, ge=0)
    """Asynchronous modes: policy versions a trained token may lag the policy being updated. A group with
    an older token is dropped (async/dropped_groups) and its prompt generated again."""
    partial_rollout: bool = True
    """Asynchronous modes: at a sync, requests in flight go on under the new weights, each token keeping
    the version that sampled it; false: the sync waits for them to finish first."""


@dataclass(config=STRICT)
class JobConfig:
    """What every stage has: where it writes, its seed, and the model it starts from."""

    output_dir: str = ""
    """Run directory: resolved config, metrics.jsonl, summary.json, checkpoints/, hf_model/, eval results."""
    seed: int = 0
    """Seed for data order, sampling and any randomness on the ranks."""
    model: ModelConfig = Field(default_factory=ModelConfig)


@dataclass(config=STRICT)
class TrainJobConfig(JobConfig):
    """`pretrain` and `sft`: the training group without the rollout group."""

    data: DataConfig = Field(default_factory=DataConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    eval: EvalConfig | None = None
    """Optional: evaluate the final model on this split after training."""
    tools: ToolsConfig = Field(default_factory=ToolsConfig)
    """Tools of the eval.agent_loop."""


@dataclass(config=STRICT)
class RLJobConfig(JobConfig):
    """`rlvr`: rollouts with vLLM, verifiable rewards, policy updates on the training group."""

    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    tools: ToolsConfig = Field(default_factory=ToolsConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-5, max_grad_norm=1.0))
    critic: CriticConfig = Field(default_factory=CriticConfig)
    """The value model, built only for adv_estimator gae."""
    train: RLTrainConfig = Field(default_factory=RLTrainConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    eval: EvalConfig | None = None
    """Validation split, scored with greedy decoding by the rollout engines."""

    @property
    def mini_batches_per_step(self) -> int:
        mini = self.algorithm.ppo_mini_batch_size
        return self.train.prompts_per_step // mini if mini else 1

    @property
    def old_logprobs_source(self) -> Literal["current", "trainer", "rollout"]:
        """Where the update's old log-probs come from. `auto`: the update's own forward when the
        update is on-policy (one update a step, synchronous, no KL in the reward, which needs the
        sampling policy's log-probs first), else a trainer forward pass before the update."""
        algo = self.algorithm
        if algo.old_logprobs != "auto":
            return algo.old_logprobs
        on_policy = (algo.ppo_epochs * self.mini_batches_per_step == 1 and not algo.use_kl_in_reward
                     and self.train.async_mode == "off")  # asynchronous: older weights sampled
        return "current" if on_policy else "trainer"


@dataclass(config=STRICT)
class EvalJobConfig(JobConfig):
    """`eval`: generate on a test split with vLLM and score with a reward."""

    eval: EvalConfig = Field(default_factory=EvalConfig)
    tools: ToolsConfig = Field(default_factory=ToolsConfig)
    """Tools of the eval.agent_loop."""
    ray: RayConfig = Field(default_factory=RayConfig)
    """The engine takes ray.cpus_per_worker CPUs (its thread count) and ray.gpus_per_worker GPUs."""


@dataclass(config=STRICT)
class PipelineStage:
    name: str = ""
    """Stage name: its output goes to output_dir/name, and the summary table names it."""
    stage: Literal["pretrain", "sft", "rlvr", "eval"] = "sft"
    """The stage to run."""
    config: str = ""
    """That stage's YAML config file (its own `output_dir` is replaced by output_dir/name)."""
    overrides: list[str] = Field(default_factory=list)
    """dotted.key=value overrides of that config, as on the command line."""


@dataclass(config=STRICT)
class PipelineConfig:
    """`pipeline`: stages run in order, each starting from the previous stage's final model."""

    output_dir: str = ""
    """Pipeline directory: a subdirectory per stage, summary.md / summary.json and report.html."""
    stages: list[PipelineStage] = Field(default_factory=list)
    """The stages in order. From the second on, model.path is the previous stage's final HF directory
    (an `eval` stage passes its input model on). Finished stages are skipped on a re-run; an
    interrupted one resumes from its last checkpoint."""
