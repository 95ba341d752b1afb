"""The config names VeRL and TRL users already type, and rlsys's for each. An unknown key that is one
of them is answered with rlsys's name (`config.loader`); docs/configuration.md prints the table.

VeRL's names are its Hydra keys, matched whole (`actor_rollout_ref.rollout.n`). TRL's are the flat
fields of its GRPOConfig, SFTConfig and ModelConfig, matched under any section as well
(`rollout.num_generations`), where a user moving them into rlsys's sections would put them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PeerName:
    peer: str
    rl: str
    """rlsys's key (or what stands for it) in an RL job."""
    train: str | None = None
    """In an SFT or pretraining job, where it differs (None: as `rl`)."""

    @property
    def in_training_job(self) -> str:
        """What an SFT or pretraining job is told: its own key, else the RL job's, said to be one."""
        if self.train is not None:
            return self.train
        return f"{self.rl} (in an RL job)" if self.rl.split(".")[0] in RL_SECTIONS else self.rl


RL_SECTIONS = ("rollout", "algorithm", "reward", "critic", "tools", "eval")
"""An RL job's own sections: an SFT or pretraining job has none of them but `eval`, with other keys."""


_VERL = {
    "actor_rollout_ref.model.path": "model.path",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "parallel.activation_checkpointing",
    "actor_rollout_ref.model.use_remove_padding": "parallel.pack_sequences",
    "actor_rollout_ref.model.lora_rank": "model.lora.rank",
    "actor_rollout_ref.model.lora_alpha": "model.lora.alpha",
    "actor_rollout_ref.model.target_modules": "model.lora.target_modules",
    "actor_rollout_ref.actor.optim.lr": "optim.lr",
    "actor_rollout_ref.actor.optim.lr_warmup_steps": "optim.warmup_steps",
    "actor_rollout_ref.actor.optim.weight_decay": "optim.weight_decay",
    "actor_rollout_ref.actor.grad_clip": "optim.max_grad_norm",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "algorithm.ppo_mini_batch_size",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "train.micro_batch_size",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "train.micro_batch_tokens",
    "actor_rollout_ref.actor.use_dynamic_bsz": "train.micro_batch_tokens (set, micro-batches by tokens)",
    "actor_rollout_ref.actor.ppo_epochs": "algorithm.ppo_epochs",
    "actor_rollout_ref.actor.clip_ratio": "algorithm.clip_ratio_low and algorithm.clip_ratio_high",
    "actor_rollout_ref.actor.clip_ratio_low": "algorithm.clip_ratio_low",
    "actor_rollout_ref.actor.clip_ratio_high": "algorithm.clip_ratio_high",
    "actor_rollout_ref.actor.clip_ratio_c": "algorithm.clip_ratio_c",
    "actor_rollout_ref.actor.loss_agg_mode": "algorithm.loss_agg",
    "actor_rollout_ref.actor.policy_loss.loss_mode": "algorithm.policy_loss",
    "actor_rollout_ref.actor.use_kl_loss": "algorithm.kl_coef (above 0, the KL loss is on)",
    "actor_rollout_ref.actor.kl_loss_coef": "algorithm.kl_coef",
    "actor_rollout_ref.actor.kl_loss_type": "algorithm.kl_estimator",
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": "parallel.cp",
    "actor_rollout_ref.actor.fsdp_config.param_offload": "parallel.offload",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": "parallel.offload",
    "actor_rollout_ref.rollout.n": "rollout.n",
    "actor_rollout_ref.rollout.temperature": "rollout.temperature",
    "actor_rollout_ref.rollout.top_p": "rollout.top_p",
    "actor_rollout_ref.rollout.response_length": "rollout.max_new_tokens",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "rollout.tensor_parallel_size",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "actor_rollout_ref.rollout.max_model_len": "rollout.max_model_len",
    "actor_rollout_ref.rollout.max_num_seqs": "rollout.max_num_seqs",
    "actor_rollout_ref.rollout.max_num_batched_tokens": "rollout.max_num_batched_tokens",
    "actor_rollout_ref.rollout.free_cache_engine": "rollout.free_memory_in_update",
    "actor_rollout_ref.rollout.dtype": "rollout.dtype",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "train.micro_batch_size",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "train.micro_batch_size",
    "algorithm.norm_adv_by_std_in_grpo": "algorithm.norm_adv_by_std",
    "data.train_batch_size": "train.prompts_per_step",
    "data.max_response_length": "rollout.max_new_tokens",
    "data.max_prompt_length": "none: every prompt that leaves the response budget in the model's context is kept "
                              "(rollout.max_model_len sets the engines' length)",
    "custom_reward_function.path": "reward.terms[].path",
    "custom_reward_function.name": "reward.terms[].function",
    "reward_model.reward_manager": "reward.terms",
    "trainer.total_training_steps": "train.steps",
    "trainer.total_epochs": "train.steps (rlsys counts steps)",
    "trainer.save_freq": "train.save_every",
    "trainer.test_freq": "train.val_every",
    "trainer.project_name": "tracking.project",
    "trainer.experiment_name": "tracking.run_name",
    "trainer.logger": "tracking.backends",
    "trainer.default_local_dir": "output_dir",
    "trainer.resume_mode": "train.resume",
    "trainer.n_gpus_per_node": "the layout's degrees (parallel.*) with ray.gpus_per_worker: 1",
    "trainer.nnodes": "the layout's degrees (parallel.*): the ranks land on the Ray cluster's nodes",
}
_TRL = {
    "model_name_or_path": "model.path",
    "num_generations": "rollout.n",
    "learning_rate": "optim.lr",
    "warmup_steps": "optim.warmup_steps",
    "weight_decay": "optim.weight_decay",
    "max_grad_norm": "optim.max_grad_norm",
    "adam_beta1": "optim.betas",
    "adam_beta2": "optim.betas",
    "adam_epsilon": "optim.eps",
    "per_device_train_batch_size": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.micro_batch_size (rlsys accumulates a step's batch in micro-batches)",
    "max_steps": "train.steps",
    "num_train_epochs": "train.steps (rlsys counts steps)",
    "logging_steps": "train.log_every",
    "save_steps": "train.save_every",
    "eval_steps": "train.val_every",
    "report_to": "tracking.backends",
    "run_name": "tracking.run_name",
    "gradient_checkpointing": "parallel.activation_checkpointing",
    "bf16": "parallel.mixed_precision",
    "max_completion_length": "rollout.max_new_tokens",
    "max_prompt_length": _VERL["data.max_prompt_length"],
    "beta": "algorithm.kl_coef",
    "epsilon": "algorithm.clip_ratio_low",
    "epsilon_high": "algorithm.clip_ratio_high",
    "num_iterations": "algorithm.ppo_epochs",
    "loss_type": "algorithm.loss_agg",
    "scale_rewards": "algorithm.norm_adv_by_std",
    "reward_funcs": "reward.terms",
    "vllm_gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "vllm_tensor_parallel_size": "rollout.tensor_parallel_size",
    "vllm_mode": "rollout.placement (colocate: colocated, server: separate)",
    "lora_r": "model.lora.rank",
    "lora_alpha": "model.lora.alpha",
    "lora_dropout": "model.lora.dropout",
    "lora_target_modules": "model.lora.target_modules",
}
_TRAIN = {  # where an SFT or pretraining job's key differs from an RL job's
    "data.train_batch_size": "train.global_batch_size",
    "per_device_train_batch_size": "train.micro_batch_size",
    "max_length": "data.max_seq_len",
    "max_seq_length": "data.max_seq_len",
}

PEER_NAMES: dict[str, PeerName] = {
    **{key: PeerName("VeRL", rl, _TRAIN.get(key)) for key, rl in _VERL.items()},
    **{key: PeerName("TRL", rl, _TRAIN.get(key)) for key, rl in _TRL.items()},
    **{key: PeerName("TRL", "rollout.max_model_len", train) for key, train in _TRAIN.items() if "." not in key
       and key not in _TRL},
}


def peer_name(typed: str) -> tuple[str, PeerName] | None:
    """The peer's key `typed` is (a VeRL key whole, a TRL field under any section), and its entry."""
    if typed in PEER_NAMES:
        return typed, PEER_NAMES[typed]
    field = typed.rsplit(".", 1)[-1]
    entry = PEER_NAMES.get(field)
    return (field, entry) if entry is not None and entry.peer == "TRL" else None


def answer(typed: str, rl_job: bool) -> str | None:
    """What to say of `typed` when it is a key a VeRL or TRL user would type ("VeRL's name; rlsys's:
    rollout.n"), else None."""
    found = peer_name(typed)
    if found is None:
        return None
    name, entry = found
    whose = f"{entry.peer}'s name" if name == typed else f"{name} is {entry.peer}'s name"
    return f"{whose}; rlsys's: {entry.rl if rl_job else entry.in_training_job}"


def markdown() -> str:
    """The table docs/configuration.md holds."""
    rows = ["| peer | their key | rlsys (RL job) | rlsys (SFT, pretraining) |", "|---|---|---|---|"]
    rows += [f"| {e.peer} | `{key}` | {e.rl} | {e.in_training_job} |" for key, e in PEER_NAMES.items()]
    return "\n".join(rows) + "\n"
