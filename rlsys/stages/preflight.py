"""Every check a stage makes before Ray starts, in order. Each check is its component's: the model
directory (`rlsys.models.directory`), a vision-language model's limits and LoRA's (`rlsys.models`),
the layout (`rlsys.parallel.parallelize.check_layout`), the engines' shape (`rlsys.rollout.vllm_engine`),
data files and batch arithmetic (`rlsys.data`), the algorithm and each RL feature
(`rlsys.rl.algorithm_checks`, `rlsys.rl.features`), the update's batches, the adapter sync, reward
terms (`rlsys.rewards.checks`) and the cluster's resources (`rlsys.actors`); a stage's list reads
as what the stage needs. The models named by Hub ids are fetched first and the keys left for the
cluster to size filled (`cluster_defaults`; a cluster joined through RAY_ADDRESS is connected to
for its GPUs).

Each failure is a ConfigError naming the key (exit code 2, one line).
"""

from __future__ import annotations

from transformers import PretrainedConfig

from rlsys.actors.cluster import check_training_resources
from rlsys.actors.engine_placement import check_engine_resources
from rlsys.config.limits import REWARD_MODEL_LAYOUTS, REWARD_MODEL_LORA, not_built
from rlsys.config.loader import ConfigError
from rlsys.config.model import ModelConfig
from rlsys.config.rollout import EvalConfig
from rlsys.config.schema import EvalJobConfig, RLJobConfig, TrainJobConfig
from rlsys.data.batching import check_train_batch
from rlsys.data.files import check_files
from rlsys.models import hub
from rlsys.models.directory import check_model_dir
from rlsys.models.lora import check_lora
from rlsys.models.vision import check_vision_language
from rlsys.parallel.dims import ParallelDims
from rlsys.parallel.parallelize import check_layout
from rlsys.rewards.checks import check_eval_reward, check_terms
from rlsys.rl.adapter_sync import check_adapter_sync
from rlsys.rl.algorithm_checks import check_algorithm, check_algorithm_against_job
from rlsys.rl.features import check_features
from rlsys.rl.update import check_update_batches
from rlsys.rollout.vllm_engine import check_block_size, check_heads_split
from rlsys.stages.cluster_defaults import fill_cluster_defaults


def check_train_job(cfg: TrainJobConfig, stage: str = "sft") -> None:
    """pretrain, sft and rm."""
    model_config, dims = _policy(cfg, stage)
    check_files(cfg.data.train_files, "data.train_files")
    check_train_batch(cfg.train, dims.dp_size)
    if stage == "rm":
        _check_reward_model_job(cfg)
    elif cfg.data.val_files or cfg.train.val_every:
        key = "data.val_files" if cfg.data.val_files else "train.val_every"
        raise ConfigError(f"{key}: held-out preference pairs are scored by the rm stage; the {stage} stage "
                          "evaluates with eval.files")
    if cfg.eval is not None:
        _check_eval(cfg.eval)
    check_training_resources(cfg.ray, dims.world_size)


def check_rl_job(cfg: RLJobConfig) -> None:
    """rlvr."""
    model_config, dims = _policy(cfg, "rlvr")
    check_adapter_sync(cfg.model, cfg.train)
    check_files(cfg.data.train_files, "data.train_files")
    if cfg.data.val_files:  # the rm stage's held-out pairs; VeRL's validation split is eval.files here
        raise ConfigError("data.val_files: the rm stage's held-out pairs; an RL run validates on eval.files "
                          "(VeRL's data.val_files)")
    check_heads_split(model_config.get_text_config(), cfg.rollout.tensor_parallel_size,
                      "rollout.tensor_parallel_size")
    check_update_batches(cfg, dims.dp_size)
    check_algorithm(cfg.algorithm, cfg.parallel)
    check_algorithm_against_job(cfg)
    check_features(cfg, model_config)
    check_terms(cfg.reward.terms, distilled=cfg.algorithm.distill is not None)
    if cfg.eval is not None:
        _check_eval(cfg.eval)
    check_training_resources(cfg.ray, dims.world_size)
    check_block_size(cfg.rollout.block_size, cfg.ray.gpus_per_worker > 0 or cfg.rollout.gpus_per_engine > 0)
    check_engine_resources(cfg, dims.world_size)


def check_eval_job(cfg: EvalJobConfig) -> None:
    """eval: one engine generates, the reward judges."""
    _prepare(cfg)
    _refuse_random_init(cfg.model)
    check_model_dir(cfg.model, "model.path")
    _check_eval(cfg.eval)
    check_training_resources(cfg.ray, 1)  # the engine takes ray.cpus_per_worker CPUs


def _policy(cfg: TrainJobConfig | RLJobConfig, stage: str) -> tuple[PretrainedConfig, ParallelDims]:
    """The job prepared, then its policy: a model directory (with weights where the stage samples from
    them), what a vision-language model or LoRA trains with so far, the layout. Returns the model's
    config and the layout's dimensions."""
    _prepare(cfg)
    rl = cfg if isinstance(cfg, RLJobConfig) else None
    if rl is not None:
        _refuse_random_init(cfg.model)
    model_config = check_model_dir(cfg.model, "model.path")
    check_vision_language(model_config, cfg.model, cfg.parallel, stage, rl)
    dims = check_layout(cfg.parallel, model_config)
    check_lora(cfg.model, cfg.parallel, model_config)
    return model_config, dims


def _prepare(cfg: TrainJobConfig | RLJobConfig | EvalJobConfig) -> None:
    """The models named by Hub ids fetched, the keys left for the cluster filled, an output directory."""
    resolve_models(cfg)
    fill_cluster_defaults(cfg)
    if not cfg.output_dir:
        raise ConfigError("output_dir: is required")


def resolve_models(cfg: TrainJobConfig | RLJobConfig | EvalJobConfig) -> None:
    """Every model the job names by a Hub id, as its local snapshot (`rlsys.models.hub`)."""
    for key, section, field in cfg.named_models():
        if getattr(section, field):
            setattr(section, field, hub.resolve(getattr(section, field), key))


def _check_reward_model_job(cfg: TrainJobConfig) -> None:
    """The rm stage: whole preference pairs in every micro-batch, every weight trained, nothing generated."""
    if cfg.model.lora.rank:
        raise not_built(REWARD_MODEL_LORA, "model.lora.rank: the rm stage trains every weight of the reward model; "
                        "no LoRA")
    if cfg.parallel.pp > 1:
        raise not_built(REWARD_MODEL_LAYOUTS, "parallel.pp: the rm stage keeps each pair in one micro-batch; not with "
                        "pipeline parallel yet")
    if cfg.parallel.cp > 1:
        raise not_built(REWARD_MODEL_LAYOUTS, "parallel.cp: a sequence's score is its last token's value, on one "
                        "rank; not with context parallel")
    refusals = {
        "train.micro_batch_tokens": (cfg.train.micro_batch_tokens, "the rm stage's micro-batches are "
                                                                   "train.micro_batch_size pairs"),
        "eval": (cfg.eval, "the rm stage generates nothing to evaluate; give held-out pairs as data.val_files"),
        "train.val_every": (cfg.train.val_every and not cfg.data.val_files, "it scores data.val_files, which is empty"),
    }
    for key, (given, why) in refusals.items():
        if given:
            raise ConfigError(f"{key}: {why}")
    if cfg.data.val_files:
        check_files(cfg.data.val_files, "data.val_files")


def _check_eval(cfg: EvalConfig) -> None:
    check_files(cfg.files, "eval.files")
    check_eval_reward(cfg.reward)


def _refuse_random_init(model: ModelConfig) -> None:
    if model.random_init:
        raise ConfigError("model.random_init: this stage samples from the model, whose weights the vLLM engines "
                          "load from model.path; random weights are for pretraining")
