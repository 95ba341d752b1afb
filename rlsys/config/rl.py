"""RL sections: rewards, the algorithm (advantages, losses, KL), the critic and the RL step loop.

Each field carries its documentation as an attribute docstring; docs/configuration.md's key tables
are generated from them (`python -m rlsys.config.docs`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field
from pydantic.dataclasses import dataclass

from rlsys.config.base import STRICT
from rlsys.config.rollout import ServingConfig
from rlsys.config.training import LoopConfig, OptimConfig


@dataclass(config=STRICT)
class JudgeConfig:
    """An LLM judge: the term's `model` generates a verdict from a template, and a parser reads
    the score from it."""

    template: str = ""
    """A text file: the judge's user message, with {prompt}, {response} and {ground_truth} filled
    in (rendered with the judge's chat template when it has one)."""
    parse: str = r"(-?\d+(?:\.\d+)?)"
    """A regular expression whose first group (or whole match) is the score, searched in the
    verdict; or `path/to/file.py:function`, called with the verdict's text and returning a number.
    A verdict that does not parse scores 0 and counts in reward/errors."""
    max_new_tokens: int = Field(default=64, gt=0)
    """Tokens of one verdict."""
    temperature: float = Field(default=0.0, ge=0, le=2)
    """The judge's sampling temperature (0: greedy)."""


@dataclass(config=STRICT)
class RewardTerm:
    name: str = ""
    """A registered reward (docs/rewards.md); or leave empty and give `path` or `model` (with `model`,
    the term's label in reward/<name>)."""
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
    model: str = ""
    """An HF model directory that scores each response, served by vLLM engines: a sequence-classification
    reward model (its single logit is the score; the prompt and response rendered with its chat template
    when it has one), or, with `judge`, a causal LM whose verdict is parsed."""
    judge: JudgeConfig | None = None
    """Make `model` a generative judge."""
    normalize: Literal["none", "sigmoid", "batch"] = "none"
    """A model's score as is, through a sigmoid, or standardised over the step's responses (mean 0, std 1)."""
    serving: ServingConfig = Field(default_factory=lambda: ServingConfig())
    """The engines that serve `model`."""


@dataclass(config=STRICT)
class RewardConfig:
    terms: list[RewardTerm] = Field(default_factory=list)
    """Reward = sum of weight x score over the terms (at least one, unless algorithm.distill gives the
    signal alone); each term is also logged as reward/<term>."""
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
class RolloutCorrectionConfig:
    """Corrections for the mismatch between the engine that sampled and the trainer (other kernels,
    bf16, another batch shape, or an older policy under async RL), from the ratio pi_old / pi_rollout
    of each response token: the trainer's old log-prob against the engine's. They compose: each
    token's policy-gradient loss is multiplied by its importance weight and by 0 where a rejection
    mask or the veto drops it (the loss keeps its normaliser: a dropped token counts as a zero)."""

    rollout_is: Literal["none", "token", "sequence"] = "none"
    """Truncated importance sampling: weight each token by min(ratio, rollout_is_threshold), or
    every token of a response by min(product of its ratios, rollout_is_threshold)."""
    rollout_is_threshold: float = Field(default=2.0, gt=1)
    """Upper bound of the importance weights (VeRL's default)."""
    rollout_is_batch_normalize: bool = False
    """Divide the truncated weights by their mean over the step's batch (over response tokens, or
    over responses with `sequence`), so that they average 1; takes a trainer pass for the old
    log-probs (the driver computes the mean before the update)."""
    rollout_rs: str = "none"
    """Rejection, one criterion or several joined by commas (each must pass). token, sequence,
    geometric: drop tokens whose ratio, or responses whose product of ratios or geometric mean of
    ratios, lies outside [rollout_rs_threshold_lower, rollout_rs_threshold] (token with both
    bounds is IcePop's two-sided mask). VeRL's divergence criteria: token_k1|k2|k3 (each token's),
    seq_sum_k1|k2|k3, seq_mean_k1|k2|k3, seq_max_k2|k3 (a response's sum, mean or maximum of its
    tokens' k1 = -log ratio, k2 = (log ratio)^2 / 2, k3 = ratio - 1 - log ratio), rejected above
    the threshold; k1 outside [lower, upper], bounds on exp(k1) = pi_rollout / pi_old as in VeRL."""
    rollout_rs_threshold: float | str = 2.0
    """The rejection's upper bound (above 1 for token, sequence, geometric), or VeRL's
    specification: one value per criterion joined by commas (or one for all), `lower_upper` for a
    k1 criterion (e.g. "0.5_2.0,0.01")."""
    rollout_rs_threshold_lower: float | None = Field(default=None, gt=0, lt=1)
    """Lower bound of token, sequence and geometric rejection (None: 1 / the upper bound)."""
    rollout_token_veto_threshold: float | None = Field(default=None, gt=0, lt=1)
    """Drop every response holding a token whose ratio is below this (a token the trainer finds
    far less likely than the engine did); None: no veto."""
    bypass_mode: bool = False
    """VeRL's bypass mode: the engine's log-probs are the old ones (no trainer pass), and the
    corrections take the ratio pi / pi_rollout of the policy being updated; `loss_type` picks the loss."""
    loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"
    """In bypass mode: ppo_clip clips pi / pi_rollout (the ratio is the correction: no importance
    weights, rejections apply); reinforce is -w A log pi with w the truncated importance weights."""
    preset: str = ""
    """One of VeRL's `RolloutCorrectionConfig` presets by name (decoupled_token_is, bypass_ppo_clip_k3_rs,
    ...: docs/algorithms.md), which sets the fields above; setting one of those beside it is refused."""

    def __post_init__(self) -> None:
        """A preset's fields set; batch normalisation of weights there are, and not in bypass mode."""
        if self.preset:
            self._apply_preset()
        if self.rollout_is_batch_normalize and self.rollout_is == "none":
            raise ValueError("rollout_is_batch_normalize: normalises the importance weights; set rollout_is: token "
                             "or sequence")
        if self.rollout_is_batch_normalize and self.bypass_mode:
            raise ValueError("rollout_is_batch_normalize: in bypass mode the weights follow the policy being "
                             "updated, so no mean over the batch precedes the update")

    def _apply_preset(self) -> None:
        if self.preset not in ROLLOUT_CORRECTION_PRESETS:
            raise ValueError(f"preset: unknown {self.preset!r}; VeRL's: {', '.join(ROLLOUT_CORRECTION_PRESETS)}")
        defaults = RolloutCorrectionConfig()
        for name, value in ROLLOUT_CORRECTION_PRESETS[self.preset].items():
            given = getattr(self, name)
            if given != getattr(defaults, name) and given != value:
                raise ValueError(f"{name}: the preset {self.preset} sets it to {value!r}; drop one of them")
            setattr(self, name, value)

    @property
    def active(self) -> bool:
        return (self.rollout_is != "none" or bool(self.rejections) or self.rollout_token_veto_threshold is not None
                or self.bypass_mode)

    @property
    def per_sequence(self) -> bool:
        """Some weight or mask depends on a whole response."""
        return (self.rollout_is == "sequence" or self.rollout_token_veto_threshold is not None
                or any(not option.startswith("token") for option in self.rejections))

    @property
    def rejections(self) -> list[str]:
        """The rejection criteria, in order (none for "none")."""
        return [] if self.rollout_rs == "none" else [part.strip() for part in self.rollout_rs.split(",")
                                                     if part.strip()]


def _preset(rollout_is: str = "none", rs: str = "none", threshold: float | str = 2.0, bypass: str = "") -> dict:
    """A preset's fields: the importance sampling, the rejection and its threshold, and in bypass mode the loss."""
    return {"rollout_is": rollout_is, "rollout_is_threshold": 2.0, "rollout_rs": rs, "rollout_rs_threshold": threshold,
            "bypass_mode": bool(bypass), "loss_type": bypass or "ppo_clip"}


GEO = "0.999_1.001"
ROLLOUT_CORRECTION_PRESETS: dict[str, dict] = {  # VeRL's RolloutCorrectionConfig class methods, default arguments
    "decoupled_token_is": _preset("token"),
    "decoupled_seq_is": _preset("sequence"),
    "decoupled_seq_is_rs": _preset("sequence", "seq_sum_k1", "0.5_2.0"),
    "decoupled_geo_rs": _preset(rs="seq_mean_k1", threshold=GEO),
    "decoupled_geo_rs_seq_tis": _preset("sequence", "seq_mean_k1", GEO),
    "decoupled_geo_rs_token_tis": _preset("token", "seq_mean_k1", GEO),
    "decoupled_k3_rs": _preset(rs="seq_mean_k3", threshold=0.01),
    "decoupled_k3_rs_seq_tis": _preset("sequence", "seq_mean_k3", 0.01),
    "decoupled_k3_rs_token_tis": _preset("token", "seq_mean_k3", 0.01),
    "bypass_ppo_clip": _preset(bypass="ppo_clip"),
    "bypass_ppo_clip_geo_rs": _preset(rs="seq_mean_k1", threshold=GEO, bypass="ppo_clip"),
    "bypass_ppo_clip_k3_rs": _preset(rs="seq_mean_k3", threshold=0.01, bypass="ppo_clip"),
    "bypass_pg_is": _preset("sequence", bypass="reinforce"),
    "bypass_pg_geo_rs": _preset(rs="seq_mean_k1", threshold=GEO, bypass="reinforce"),
    "bypass_pg_geo_rs_seq_tis": _preset("sequence", "seq_mean_k1", GEO, bypass="reinforce"),
    "bypass_pg_geo_rs_token_tis": _preset("token", "seq_mean_k1", GEO, bypass="reinforce"),
}


@dataclass(config=STRICT)
class DistillConfig:
    """On-policy distillation: a frozen teacher's log-prob of every token the policy sampled, served
    by vLLM engines (prompt log-probs of prompt + response), gives the per-token reverse KL
    log pi(token) - log teacher(token), taken with the engine's sampling log-probs of the policy."""

    teacher: str = ""
    """The teacher's HF model directory; its tokenizer must be the policy's."""
    coef: float = Field(default=1.0, gt=0)
    """Weight of the distillation signal: the sampled token's reverse KL, or with top_k the top-k KL."""
    source: Literal["engine", "trainer"] = "engine"
    """engine: the teacher served by vLLM engines (`serving`), its log-probs vLLM's prompt log-probs;
    trainer: a frozen copy in the training group, in the policy's layout (each rank holds its shard
    of it, as of a reference model), its log-probs a forward pass there."""
    mode: Literal["advantage", "penalty"] = "advantage"
    """advantage: each response token's advantage is coef x (log teacher - log pi), added to the
    estimator's advantages of the reward terms when there are any (prime-rl's and Thinking Machines'
    on-policy distillation); penalty: each token's reward loses coef x the reverse KL before the
    advantage estimator, as a KL penalty toward the teacher."""
    top_k: int = Field(default=0, ge=0, le=20)
    """0: the sampled-token signal of `mode`. k > 0: instead, the teacher's k most likely tokens at
    every response position and a loss term coef x KL(teacher || policy) over them (VeRL's top-k
    forward KL: the sum over the k of the teacher's probability times its log-prob minus the
    policy's), dense where one sampled token says little; `mode` stays advantage. At most 20, the
    log-probs a vLLM engine gives a position."""
    serving: ServingConfig = Field(default_factory=lambda: ServingConfig())
    """The engines that serve the teacher (source: engine)."""

    def __post_init__(self) -> None:
        if self.top_k and self.mode == "penalty":
            raise ValueError("top_k: the top-k KL is a loss term; mode: penalty puts the sampled token's KL in the "
                             "reward instead (set top_k: 0, or mode: advantage)")


@dataclass(config=STRICT)
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """Advantage estimator (VeRL's names): grpo (group-normalised; Dr. GRPO without
    norm_adv_by_std), grpo_passk, rloo, opo, gpg, remax (the greedy response's reward as the
    baseline), reinforce_plus_plus, reinforce_plus_plus_baseline, optimal_token_baseline,
    tir_optimal_token_baseline, gae (PPO with a critic, see `critic`), or one registered by a file in
    `extensions`."""
    norm_adv_by_std: bool = True
    """grpo, grpo_passk: divide by the group's reward std; false gives Dr. GRPO's mean-only
    centring."""
    gamma: float = Field(default=1.0, ge=0, le=1)
    """reinforce_plus_plus and gae: discount of the token rewards' returns."""
    lam: float = Field(default=1.0, ge=0, le=1)
    """gae: the GAE lambda (1: Monte-Carlo returns minus the values)."""
    policy_loss: str = "vanilla"
    """Policy loss (VeRL's names): vanilla (PPO clip with dual clip), gspo (sequence-level ratio,
    averaged per sequence), cispo, sapo, geo_mean (GMPO), clip_cov, kl_cov, gpg, reinforce (the
    plain -A log p), or one registered by a file in `extensions`."""
    clip_ratio_low: float = Field(default=0.2, ge=0)
    """PPO clip: ratio >= 1 - clip_ratio_low."""
    clip_ratio_high: float = Field(default=0.28, ge=0)
    """PPO clip: ratio <= 1 + clip_ratio_high (DAPO's clip-higher when above the low bound)."""
    clip_ratio_c: float = Field(default=3.0, gt=1)
    """Dual clip: a negative advantage's token loss is at most -A x clip_ratio_c (VeRL's default)."""
    tau_pos: float = Field(default=1.0, gt=0)
    """sapo: the gate's temperature where the advantage is positive."""
    tau_neg: float = Field(default=1.05, gt=0)
    """sapo: the gate's temperature where the advantage is not positive."""
    clip_cov_ratio: float = Field(default=0.0002, gt=0, le=1)
    """clip_cov: the share of a micro-batch's response tokens cut out of the gradient."""
    clip_cov_lb: float = 1.0
    """clip_cov: tokens whose advantage-log-prob covariance is above this can be cut."""
    clip_cov_ub: float = 5.0
    """clip_cov: ... and below this."""
    kl_cov_ratio: float = Field(default=0.0002, gt=0, le=1)
    """kl_cov: the share of a micro-batch's response tokens (the largest covariances) given the
    |log-ratio| penalty."""
    ppo_kl_coef: float = Field(default=0.1, ge=0)
    """kl_cov: the penalty's coefficient."""
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
    rollout_correction: RolloutCorrectionConfig = Field(default_factory=lambda: RolloutCorrectionConfig())
    """Corrections for the engine sampling with other numbers than the trainer's (VeRL's
    algorithm.rollout_correction): importance weights, rejection masks, a veto."""
    distill: DistillConfig | None = None
    """On-policy distillation from a teacher model (empty: off)."""
    router_replay: Literal["none", "r2", "r3"] = "none"
    """MoE routing replay. r2: the experts each token went to in the trainer's pass that computes
    the old log-probs (taken even when the update is on-policy) are the experts every update
    forward of the step routes it to, weighted by the current router (VeRL's, slime's R2). r3:
    the experts the rollout engine routed each token to (vLLM's routed experts, returned on GPU) are
    the ones every trainer forward of the step routes it to (VeRL's R3)."""
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

    def __post_init__(self) -> None:
        """Bypass mode takes the engine's log-probs as the old ones and its loss from its loss_type; outside
        it, a correction needs old log-probs other than the engine's."""
        correction = self.rollout_correction
        if correction.bypass_mode and self.policy_loss != "vanilla":
            raise ValueError(f"policy_loss: bypass mode picks its loss by rollout_correction.loss_type (ppo_clip or "
                             f"reinforce), not {self.policy_loss}; leave policy_loss: vanilla")
        if correction.bypass_mode and self.old_logprobs not in ("auto", "rollout"):
            raise ValueError(f"old_logprobs: bypass mode takes the engine's log-probs as the old ones, not "
                             f"{self.old_logprobs}'s")
        if not correction.bypass_mode and correction.active and self.old_logprobs == "rollout":
            raise ValueError("rollout_correction: with old_logprobs: rollout every ratio is 1; use old_logprobs: "
                             "auto or trainer (or bypass_mode: true)")


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
    record_schedule: bool = True
    """Asynchronous modes: write schedule.jsonl beside the metrics, the order of the events that decided
    the run's tokens (requests, syncs and tool turns by engine step; the groups each step took)."""
    replay: str | None = None
    """Asynchronous modes: a recorded run's schedule.jsonl (or its output_dir) to follow instead of the
    clock: with that run's config and seed the job repeats its tokens and metrics exactly (on CPU)."""
