"""The job configs: each stage's sections put together (`python -m rlsys.run <stage> --config FILE`).

Each field carries its documentation as an attribute docstring; docs/configuration.md's key tables
are generated from them (`python -m rlsys.config.docs`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field
from pydantic.dataclasses import dataclass

from rlsys.config.base import STRICT
from rlsys.config.layout import ParallelConfig, RayConfig
from rlsys.config.model import ModelConfig
from rlsys.config.rl import AlgorithmConfig, CriticConfig, RewardConfig, RLTrainConfig
from rlsys.config.rollout import EvalConfig, RolloutConfig, ServingConfig, ToolsConfig
from rlsys.config.training import DataConfig, OptimConfig, TrackingConfig, TrainConfig


@dataclass(config=STRICT)
class JobConfig:
    """What every stage has: where it writes, its seed, and the model it starts from."""

    output_dir: str = ""
    """Run directory: resolved config, metrics.jsonl, summary.json, checkpoints/, hf_model/, eval results."""
    seed: int = 0
    """Seed for data order, sampling and any randomness on the ranks."""
    model: ModelConfig = Field(default_factory=ModelConfig)

    def named_models(self) -> list[tuple[str, Any, str]]:
        """Every model the job names (a directory or a Hub id), as (config key, the section holding it,
        its field): the model it trains or evaluates."""
        return [("model.path", self.model, "path")]


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

    def named_models(self) -> list[tuple[str, Any, str]]:
        """The policy, and each reward model's or judge's, a distillation teacher's."""
        named = [*super().named_models(),
                 *((f"reward.terms[{i}].model", term, "model") for i, term in enumerate(self.reward.terms))]
        if self.algorithm.distill is not None:
            named.append(("algorithm.distill.teacher", self.algorithm.distill, "teacher"))
        return named

    def engine_groups(self) -> list[tuple[str, RolloutConfig | ServingConfig]]:
        """Each group of vLLM engines the run starts, with its config key: the rollout's, each reward
        model's or judge's, an engine-served teacher's."""
        groups: list[tuple[str, RolloutConfig | ServingConfig]] = [("rollout", self.rollout)]
        groups += [(f"reward.terms[{i}].serving", term.serving) for i, term in enumerate(self.reward.terms)
                   if term.model]
        if self.algorithm.distill is not None and self.algorithm.distill.source == "engine":
            groups.append(("algorithm.distill.serving", self.algorithm.distill.serving))
        return groups


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
    stage: Literal["pretrain", "sft", "rm", "rlvr", "eval"] = "sft"
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
    (an `eval` or `rm` stage passes its input model on; an rlvr stage's reward term names an rm stage's
    reward model as `model: stage:<name>`). Finished stages are skipped on a re-run; an interrupted one
    resumes from its last checkpoint."""
    seed: int | None = None
    """Every stage's `seed`, in place of the one its config or overrides give (null: each stage's own):
    one command runs the whole chain again at another seed."""
