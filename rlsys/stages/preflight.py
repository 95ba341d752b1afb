"""Checks that need more than types, all made before Ray starts: the model directory,
data files, reward functions, batch arithmetic and the cluster's resources. The keys left for the
cluster to size are filled first (`cluster_defaults`; a cluster joined through RAY_ADDRESS is
connected to for its GPUs).

Each failure is a ConfigError naming the key (exit code 2, one line).
"""

from __future__ import annotations

import glob
import os

from transformers import PretrainedConfig

from rlsys.config.layout import ParallelConfig, RayConfig
from rlsys.config.limits import (
    LORA_ADAPTER_SYNC_ASYNC,
    LORA_LAYOUTS,
    LORA_MOE,
    MODEL_FAMILIES,
    REWARD_MODEL_LAYOUTS,
    REWARD_MODEL_LORA,
    VISION_LANGUAGE,
    not_built,
)
from rlsys.config.loader import ConfigError, first_line
from rlsys.config.model import ModelConfig
from rlsys.config.rl import RewardTerm
from rlsys.config.rollout import EvalConfig
from rlsys.config.schema import EvalJobConfig, RLJobConfig, TrainJobConfig
from rlsys.config.training import TrainConfig
from rlsys.models import hub
from rlsys.models.moe import moe_family
from rlsys.models.vision import VL_FAMILIES, is_vision_language, model_class
from rlsys.parallel.dims import LayoutError, ParallelDims
from rlsys.parallel.pipeline_stages import stages_per_rank
from rlsys.parallel.tp import check_tp_family
from rlsys.rl.features import check_features
from rlsys.stages.algorithm_checks import check_algorithm, check_algorithm_against_job
from rlsys.stages.cluster_defaults import fill_cluster_defaults

_WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin", "model.safetensors.index.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def check_train_job(cfg: TrainJobConfig, stage: str = "sft") -> None:
    resolve_models(cfg)
    fill_cluster_defaults(cfg)
    _require(cfg.output_dir, "output_dir")
    model_config = check_model_dir(cfg.model, "model.path")
    _check_vision_language(model_config, cfg.model, cfg.parallel, stage)
    dims = check_layout(cfg.parallel, model_config)
    check_lora(cfg.model, cfg.parallel, model_config)
    _check_files(cfg.data.train_files, "data.train_files")
    check_train_batch(cfg.train, dims.dp_size)
    if stage == "rm":
        _check_reward_model_job(cfg)
    elif cfg.data.val_files or cfg.train.val_every:
        key = "data.val_files" if cfg.data.val_files else "train.val_every"
        raise ConfigError(f"{key}: held-out preference pairs are scored by the rm stage; the {stage} stage "
                          "evaluates with eval.files")
    if cfg.eval is not None:
        _check_eval(cfg.eval)
    _check_training_resources(cfg.ray, dims.world_size)


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
        _check_files(cfg.data.val_files, "data.val_files")


def check_rl_job(cfg: RLJobConfig) -> None:
    from rlsys.rewards import registered_rewards
    from rlsys.rewards.loading import resolve_term

    resolve_models(cfg)
    fill_cluster_defaults(cfg)
    _require(cfg.output_dir, "output_dir")
    _refuse_random_init(cfg.model)
    model_config = check_model_dir(cfg.model, "model.path")
    _check_vision_language(model_config, cfg.model, cfg.parallel, "rlvr", cfg)
    dims = check_layout(cfg.parallel, model_config)
    check_lora(cfg.model, cfg.parallel, model_config)
    if cfg.model.lora.syncs_adapters and cfg.train.async_mode != "off":
        raise not_built(LORA_ADAPTER_SYNC_ASYNC, "train.async_mode: the adapter sync runs with async_mode: off; "
                        "for asynchronous RL with LoRA set model.lora.sync: merged")
    _check_files(cfg.data.train_files, "data.train_files")
    if cfg.data.val_files:  # the rm stage's held-out pairs; VeRL's validation split is eval.files here
        raise ConfigError("data.val_files: the rm stage's held-out pairs; an RL run validates on eval.files "
                          "(VeRL's data.val_files)")
    _check_heads_split(model_config.get_text_config(), cfg.rollout.tensor_parallel_size,
                       "rollout.tensor_parallel_size")
    prompts, mini = cfg.train.prompts_per_step, cfg.algorithm.ppo_mini_batch_size
    if mini and prompts % mini:
        raise ConfigError(f"algorithm.ppo_mini_batch_size: {mini} does not divide train.prompts_per_step ({prompts})")
    check_algorithm(cfg.algorithm, cfg.parallel)
    check_algorithm_against_job(cfg)
    check_features(cfg, model_config)
    check_rl_batch(cfg, dims.dp_size)
    if not cfg.reward.terms and cfg.algorithm.distill is None:
        raise ConfigError(f"reward.terms: empty; name at least one reward (registered: "
                          f"{', '.join(registered_rewards())}), give a path or a model, or set algorithm.distill")
    for i, term in enumerate(cfg.reward.terms):
        if term.model:
            check_model_term(term, f"reward.terms[{i}]")
        elif not term.name and not term.path:
            raise ConfigError(f"reward.terms[{i}]: give a registered name, a path or a model")
        else:
            resolve_term(term, f"reward.terms[{i}]")
    if cfg.algorithm.distill is not None:
        teacher_config = check_teacher(cfg.algorithm.distill.teacher, cfg.model.path)
        if cfg.algorithm.distill.source == "trainer":
            try:
                check_layout(cfg.parallel, teacher_config)
            except ConfigError as err:
                raise ConfigError(f"algorithm.distill.source: trainer puts the teacher in the policy's layout, "
                                  f"which it does not fit: {err}") from None
    if cfg.eval is not None:
        _check_eval(cfg.eval)
    _check_training_resources(cfg.ray, dims.world_size)
    _check_block_size(cfg.rollout.block_size, cfg.ray.gpus_per_worker > 0 or cfg.rollout.gpus_per_engine > 0)
    _check_engine_resources(cfg, dims.world_size)


def check_train_batch(train: TrainConfig, dp: int) -> None:
    """The global batch splits evenly over the data-parallel ranks (and their micro-batches)."""
    if train.micro_batch_tokens is not None:
        if train.global_batch_size % dp:
            raise ConfigError(f"train.global_batch_size: {train.global_batch_size} is not divisible by the "
                              f"data-parallel size ({dp})")
    elif train.global_batch_size % (train.micro_batch_size * dp):
        raise ConfigError(
            f"train.global_batch_size: {train.global_batch_size} is not divisible by "
            f"train.micro_batch_size ({train.micro_batch_size}) x data-parallel size ({dp})"
        )


def check_rl_batch(cfg: RLJobConfig, dp: int) -> None:
    """Each update's responses split evenly over the data-parallel ranks."""
    responses = (cfg.algorithm.ppo_mini_batch_size or cfg.train.prompts_per_step) * cfg.rollout.n
    if responses % dp:
        raise ConfigError(f"train.prompts_per_step: {responses} responses per update cannot be split evenly "
                          f"across {dp} data-parallel ranks")


def check_eval_job(cfg: EvalJobConfig) -> None:
    resolve_models(cfg)
    fill_cluster_defaults(cfg)
    _require(cfg.output_dir, "output_dir")
    _refuse_random_init(cfg.model)
    check_model_dir(cfg.model, "model.path")
    _check_eval(cfg.eval)
    _check_training_resources(cfg.ray, 1)  # the engine takes ray.cpus_per_worker CPUs


def resolve_models(cfg: TrainJobConfig | RLJobConfig | EvalJobConfig) -> None:
    """Every model the job names by a Hub id, as its local snapshot (`rlsys.models.hub`)."""
    for key, section, field in cfg.named_models():
        if getattr(section, field):
            setattr(section, field, hub.resolve(getattr(section, field), key))


def check_model_term(term: RewardTerm, key: str) -> None:
    """A reward term's model: a one-logit sequence-classification (reward) model, or with `judge` a
    causal LM; the judge's template and parser readable."""
    from rlsys.rewards.model_terms import read_template, verdict_parser

    if term.path:
        raise ConfigError(f"{key}: give a model or a path, not both")
    if term.model.startswith("stage:"):
        raise ConfigError(f"{key}.model: {term.model!r} names a pipeline's rm stage; only a pipeline's rlvr stage "
                          "can use it")
    config = check_model_dir(ModelConfig(path=term.model), f"{key}.model")
    kinds = getattr(config, "architectures", None) or ["?"]
    if term.judge is not None:
        if not kinds[0].endswith("ForCausalLM"):
            raise ConfigError(f"{key}.model: a judge generates, so it must be a causal LM; {term.model} is {kinds[0]}")
        read_template(term.judge.template, f"{key}.judge.template")
        verdict_parser(term.judge, f"{key}.judge")
        return
    if not kinds[0].endswith(("ForSequenceClassification", "ForRewardModel")) or config.num_labels != 1:
        raise ConfigError(f"{key}.model: a reward model has a one-logit sequence-classification head; {term.model} "
                          f"is {kinds[0]} with {config.num_labels} labels (for a generative judge add {key}.judge)")


def check_teacher(teacher: str, policy: str) -> PretrainedConfig:
    """The distillation teacher: a causal LM whose tokenizer is the policy's (its log-probs are of
    the policy's token ids). Returns its config."""
    from rlsys.data.tokenizer import load_tokenizer

    key = "algorithm.distill.teacher"
    config = check_model_dir(ModelConfig(path=teacher), key)
    kind = (getattr(config, "architectures", None) or ["?"])[0]
    if not kind.endswith("ForCausalLM"):
        raise ConfigError(f"{key}: the teacher must be a causal LM; {teacher} is {kind}")
    ours, theirs = load_tokenizer(policy, "model.path").get_vocab(), load_tokenizer(teacher, key).get_vocab()
    if ours != theirs:
        differ = sum(ours.get(token) != index for token, index in theirs.items()) + len(ours.keys() - theirs.keys())
        raise ConfigError(f"{key}: its tokenizer differs from model.path's ({len(theirs)} vs {len(ours)} tokens, "
                          f"{differ} mapped differently); distillation compares log-probs of the same token ids")
    return config


def check_model_dir(model: ModelConfig, key: str):
    """A Hugging Face causal-LM directory: a config transformers reads, weights, tokenizer files.
    Returns the model's config."""
    config = read_model_config(model.path, key)
    if not model.random_init and not any(glob.glob(os.path.join(model.path, pattern)) for pattern in _WEIGHT_FILES):
        raise ConfigError(f"{key}: no weights in {model.path} (expected *.safetensors or pytorch_model*.bin)")
    if not any(os.path.isfile(os.path.join(model.path, name)) for name in _TOKENIZER_FILES):
        raise ConfigError(f"{key}: no tokenizer files in {model.path} (expected one of {', '.join(_TOKENIZER_FILES)})")
    return config


def _check_vision_language(config, model: ModelConfig, parallel: ParallelConfig, stage: str,
                           rl: RLJobConfig | None = None) -> None:
    """What a vision-language model trains with so far (docs/vision.md): Qwen2-VL, Qwen2.5-VL and
    Qwen3-VL, the sft and rlvr stages, data and tensor parallel, every weight or LoRA adapters on the
    language model; in RL, the single-turn or tool loop, a critic too, without a teacher, with the
    trainer's processor settings."""
    if not is_vision_language(config):
        if model.freeze_vision:
            raise ConfigError(f"model.freeze_vision: {model.path} has no vision tower")
        return
    if config.model_type not in VL_FAMILIES:
        raise not_built(MODEL_FAMILIES, f"model.path: {model.path} is a vision-language model of type "
                        f"{config.model_type!r}; training is built for {', '.join(VL_FAMILIES)} (docs/vision.md)")
    refusals = {
        "stage": stage not in ("sft", "rlvr"), "parallel.pp": parallel.pp > 1, "parallel.cp": parallel.cp > 1,
        "parallel.sequence_parallel": parallel.sequence_parallel,
    }
    if rl is not None:
        refusals.update({
            "algorithm.distill": rl.algorithm.distill is not None,
            "rollout.agent_loop": rl.rollout.agent_loop == "openai",
            "rollout.engine_kwargs.mm_processor_kwargs": "mm_processor_kwargs" in rl.rollout.engine_kwargs,
        })
    for key, refused in refusals.items():
        if refused:
            raise not_built(VISION_LANGUAGE, f"{key}: not built yet for a vision-language model "
                            f"({type(config).__name__}): it trains with the sft and rlvr stages on data- and "
                            "tensor-parallel layouts, in RL with the single_turn or tool loop (docs/vision.md)")


def _refuse_random_init(model: ModelConfig) -> None:
    if model.random_init:
        raise ConfigError("model.random_init: this stage samples from the model, whose weights the vLLM engines "
                          "load from model.path; random weights are for pretraining")


def read_model_config(path: str, key: str):
    """The config of the model directory `path`, which transformers reads and rlsys can train."""
    from transformers import AutoConfig

    _require(path, key)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"{key}: not a Hugging Face model directory (no config.json): {path}")
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as err:  # transformers raises several types for unreadable configs
        raise ConfigError(f"{key}: {path}/config.json cannot be read by transformers: {first_line(err)}") from None
    try:
        moe_family(config)
    except ValueError as err:  # an MoE model of another family
        raise not_built(MODEL_FAMILIES, f"{key}: {err}") from None
    return config


def check_layout(parallel: ParallelConfig, model_config: PretrainedConfig) -> ParallelDims:
    """The training layout, checked against what is built so far and against the model."""
    try:
        dims = ParallelDims.of(parallel)
        dims.check_model(model_config.get_text_config(), stages_per_rank(parallel))  # a VL model's language model
        if dims.tp > 1:
            check_tp_family(model_config)
    except LayoutError as err:
        raise ConfigError(str(err)) from None
    return dims


def check_lora(model: ModelConfig, parallel: ParallelConfig, model_config: PretrainedConfig) -> None:
    """LoRA trains on data- and context-parallel layouts of dense models, on target modules the
    model has."""
    if not model.lora.rank:
        return
    for degree in ("tp", "pp", "ep"):
        if getattr(parallel, degree) > 1:
            raise not_built(LORA_LAYOUTS, f"parallel.{degree}: LoRA adapters (model.lora.rank) train on dp_shard, "
                            f"dp_replicate and cp layouts; not with parallel.{degree} > 1 yet")
    if moe_family(model_config):
        raise not_built(LORA_MOE, f"model.lora.rank: LoRA on MoE models ({model_config.model_type}) is not built yet")
    import torch

    from rlsys.models.lora import inject

    with torch.device("meta"):
        try:
            inject(model_class(model_config).from_config(model_config), model.lora)
        except ValueError as err:
            raise ConfigError(f"model.lora.target_modules: {first_line(err)}") from None


def _check_block_size(block_size: int | None, on_gpu: bool) -> None:
    """vLLM's CPU attention takes KV blocks of a multiple of 32 tokens."""
    if block_size is not None and not on_gpu and block_size % 32:
        raise ConfigError(f"rollout.block_size: {block_size} tokens; on CPU a multiple of 32")


def _check_heads_split(model_config: PretrainedConfig, degree: int, key: str) -> None:
    """Tensor parallelism splits attention heads (and key/value heads) evenly across ranks."""
    heads = getattr(model_config, "num_attention_heads", None)
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    if heads and degree > 1 and (heads % degree or (kv_heads % degree and degree % kv_heads)):
        raise ConfigError(f"{key}: {degree} does not split the model's {heads} attention heads "
                          f"({kv_heads} key/value heads) evenly")


def _check_eval(cfg: EvalConfig) -> None:
    from rlsys.rewards import registered_rewards
    from rlsys.rewards.loading import eval_term, resolve_term

    _check_files(cfg.files, "eval.files")
    if not cfg.reward:
        raise ConfigError(f"eval.reward: empty; name the reward that judges a response (registered: "
                          f"{', '.join(registered_rewards())}) or give path/to/file.py[:function]")
    term = eval_term(cfg.reward)
    if term.name and term.name not in registered_rewards():
        raise ConfigError(f"eval.reward: unknown reward {cfg.reward!r}; registered: "
                          f"{', '.join(registered_rewards())} (or give path/to/file.py[:function])")
    resolve_term(term, "eval.reward")


def _check_training_resources(ray_cfg: RayConfig, world_size: int) -> None:
    from rlsys.actors.cluster import check_resources

    if ray_cfg.gpus_per_worker not in (0, 1):
        raise ConfigError(f"ray.gpus_per_worker: {ray_cfg.gpus_per_worker:g}; a training rank drives one GPU "
                          f"(1; 0 trains on CPU): two ranks on one GPU are refused by NCCL, and engines share a "
                          f"rank's GPU by rollout.placement: colocated")
    check_resources(world_size, ray_cfg.cpus_per_worker, ray_cfg.gpus_per_worker, "ray.cpus_per_worker", ray_cfg)


def _check_engine_resources(cfg: RLJobConfig, world_size: int) -> None:
    """Every group of engines fits: colocated ones on the training ranks' GPUs, separate ones in the
    cluster; a tensor-parallel engine's ranks each on a GPU of their own."""
    from rlsys.actors.cluster import check_resources
    from rlsys.actors.engine_placement import check_colocated_engines

    for key, engines in cfg.engine_groups():
        tp = engines.tensor_parallel_size
        if engines.placement == "colocated":
            check_colocated_engines(engines, world_size, cfg.ray.gpus_per_worker, key)
            continue
        if tp > 1 and engines.gpus_per_engine not in (0, 1):
            raise ConfigError(f"{key}.gpus_per_engine: {engines.gpus_per_engine:g}; each of a tensor-parallel "
                              f"engine's {tp} ranks takes a GPU of its own (1)")
        check_resources(engines.num_engines, engines.cpus_per_engine, engines.gpus_per_engine * tp,
                        f"{key}.cpus_per_engine", cfg.ray)
    _check_separate_gpus(cfg, world_size)


def _check_separate_gpus(cfg: RLJobConfig, world_size: int) -> None:
    """Engines of their own take GPUs beside the training ranks': all of them must fit the cluster's."""
    from rlsys.actors.cluster import cluster_gpus

    separate = [(key, engines) for key, engines in cfg.engine_groups()
                if engines.placement == "separate" and engines.gpus_per_engine]
    if not separate:
        return
    training = world_size * cfg.ray.gpus_per_worker
    engines = sum(group.num_engines * group.tensor_parallel_size * group.gpus_per_engine for _, group in separate)
    total = cluster_gpus(cfg.ray)
    if training + engines > total:
        key = separate[0][0]
        raise ConfigError(f"{key}.gpus_per_engine: the training ranks take {training:g} GPUs and the separate "
                          f"engines {engines:g} of their own, {training + engines:g} in all, but the Ray cluster has "
                          f"{total:g}; lower {key}.num_engines or the parallel degrees, set {key}.placement: "
                          f"colocated, or {key}.gpus_per_engine: 0 to generate on CPU")


def _check_files(paths: list[str], key: str) -> None:
    if not paths:
        raise ConfigError(f"{key}: at least one file is required")
    for i, path in enumerate(paths):
        if not os.path.isfile(path):
            raise ConfigError(f"{key}[{i}]: file not found: {path}")


def _require(value: str, key: str) -> None:
    if not value:
        raise ConfigError(f"{key}: is required")
