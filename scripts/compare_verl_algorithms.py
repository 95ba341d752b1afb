"""rlsys's advantage estimators and policy losses beside VeRL's own functions, on random batches.

    git clone https://github.com/volcengine/verl
    .venv/bin/python scripts/compare_verl_algorithms.py verl/verl/trainer/ppo/core_algos.py \
        --rollout-corr verl/verl/trainer/ppo/rollout_corr_helper.py

VeRL need not be installed: its functions are read from the file, with the few helpers they
import from the rest of VeRL given here. Prints, for each name both register, the largest
difference of the advantages, or of the loss and of its gradient with respect to the log-probs,
and for each rejection criterion the tokens whose keep/drop differs.
"""

from __future__ import annotations

import argparse
import re
import types

import numpy as np
import torch

from rlsys.algorithms.advantages import ADVANTAGES, AdvantageInputs
from rlsys.algorithms.aggregation import aggregate
from rlsys.algorithms.policy_loss import POLICY_LOSSES
from rlsys.algorithms.rollout_correction import (
    DIVERGENCE_REJECTIONS,
    correction_factors,
    is_weight_mean,
    rejection_bounds,
    rejection_keep,
    sequence_mismatch_metrics,
)
from rlsys.config.rl import AlgorithmConfig, RolloutCorrectionConfig

ESTIMATORS = ["grpo", "grpo_passk", "rloo", "opo", "gpg", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]
LOSSES = ["vanilla", "gspo", "cispo", "sapo", "geo_mean", "clip_cov", "kl_cov", "gpg"]
ALGO = AlgorithmConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, clip_cov_ratio=0.05,
                       clip_cov_lb=-1.0, clip_cov_ub=5.0, kl_cov_ratio=0.05)


def load_verl(path: str) -> dict:
    """A VeRL module's namespace (core_algos, rollout_corr_helper), its imports from the rest of
    VeRL replaced."""
    source = open(path).read()
    source = re.sub(r"^(from verl|import verl|from omegaconf).*$", "", source, flags=re.MULTILINE)

    def masked_sum(values, mask, axis=None):
        return (torch.where(mask.bool(), values, 0.0) * mask).sum(axis=axis)

    def masked_mean(values, mask, axis=None):
        return masked_sum(values, mask, axis) / (mask.sum(axis=axis) + 1e-8)

    def masked_whiten(values, mask, shift_mean=True):
        mean = masked_mean(values, mask)
        var = masked_mean((values - mean) ** 2, mask) * mask.sum() / (mask.sum() - 1)
        return (values - mean) * torch.rsqrt(var + 1e-8)

    class ActorConfig(types.SimpleNamespace):
        def get(self, key, default=None):
            return getattr(self, key, default)

    namespace = {"verl_F": types.SimpleNamespace(masked_sum=masked_sum, masked_mean=masked_mean,
                                                 masked_whiten=masked_whiten),
                 "ActorConfig": ActorConfig, "AlgoConfig": dict, "DictConfig": dict,
                 "deprecated": lambda *a, **k: (lambda fn: fn), "__name__": "verl_core_algos"}
    exec(compile(source, path, "exec"), namespace)
    return namespace


def verl_actor_config(verl: dict):
    policy_loss = types.SimpleNamespace(clip_cov_ratio=ALGO.clip_cov_ratio, clip_cov_lb=ALGO.clip_cov_lb,
                                        clip_cov_ub=ALGO.clip_cov_ub, kl_cov_ratio=ALGO.kl_cov_ratio,
                                        ppo_kl_coef=ALGO.ppo_kl_coef)
    return verl["ActorConfig"](clip_ratio=ALGO.clip_ratio_low, clip_ratio_low=ALGO.clip_ratio_low,
                               clip_ratio_high=ALGO.clip_ratio_high, clip_ratio_c=ALGO.clip_ratio_c,
                               tau_pos=ALGO.tau_pos, tau_neg=ALGO.tau_neg, policy_loss=policy_loss,
                               global_batch_info={})


def batch(seed: int, rows: int = 16, length: int = 12, group: int = 4) -> dict:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (rows,), generator=generator)
    mask = (torch.arange(length)[None] < lengths[:, None]).float()
    scores = torch.randint(0, 2, (rows,), generator=generator).float() * torch.rand(rows, generator=generator)
    rewards = torch.zeros(rows, length)
    rewards[torch.arange(rows), lengths - 1] = scores
    logprobs = -torch.rand(rows, length, generator=generator) * 3
    old = logprobs + torch.randn(rows, length, generator=generator) * 0.3
    advantages = torch.randn(rows, 1, generator=generator) * mask
    return {"mask": mask, "rewards": rewards, "groups": torch.arange(rows) // group, "logprobs": logprobs,
            "old": old, "advantages": advantages}


class _AlgoConfig(dict):
    """VeRL's AlgoConfig as its estimators read it: by key (`config.get`) and by attribute."""

    __getattr__ = dict.__getitem__


def compare_estimator(verl: dict, name: str, data: dict) -> float:
    ours = ADVANTAGES[name](AdvantageInputs(data["rewards"], data["mask"], data["groups"]), ALGO)
    fn = verl["get_adv_estimator_fn"](name)
    config = _AlgoConfig(norm_adv_by_std_in_grpo=ALGO.norm_adv_by_std, gamma=ALGO.gamma)
    theirs, _ = fn(token_level_rewards=data["rewards"].clone(), response_mask=data["mask"],
                   index=data["groups"].numpy(), config=config)
    return (ours - theirs).abs().max().item()


TOKEN_BASELINES = {"optimal_token_baseline": "compute_optimal_token_baseline_advantage",
                   "tir_optimal_token_baseline": "compute_multi_turn_optimal_token_baseline_advantage"}


def compare_token_baseline(verl: dict, name: str, data: dict, seed: int, weighted: bool) -> float:
    """An optimal-token-baseline estimator on responses with tool turns inside (masked tokens after
    the first), with the rollout importance weights or without."""
    generator = torch.Generator().manual_seed(seed)
    mask = data["mask"] * (torch.rand(data["mask"].shape, generator=generator) > 0.25)
    mask[:, 0] = 1.0
    last = mask.shape[1] - 1 - mask.flip(1).argmax(1)
    rewards = torch.zeros_like(data["rewards"])
    rewards[torch.arange(len(last)), last] = data["rewards"].sum(-1)
    sum_pi_squared = torch.rand(mask.shape, generator=generator) * data["old"].exp()
    weights = torch.rand(mask.shape, generator=generator) * 2 if weighted else None
    ours = ADVANTAGES[name](AdvantageInputs(rewards, mask, data["groups"], old_logprobs=data["old"],
                                            sum_pi_squared=sum_pi_squared, is_weights=weights), ALGO)
    theirs, _ = verl[TOKEN_BASELINES[name]](rewards.clone(), mask, data["groups"].numpy(), data["old"],
                                            sum_pi_squared, rollout_is_weights=weights)
    return (ours - theirs).abs().max().item()


def compare_remax(verl: dict, data: dict, seed: int) -> float:
    """ReMax with random greedy scores; VeRL's leaves the return on padding, which no loss reads."""
    baselines = torch.rand(len(data["mask"]), generator=torch.Generator().manual_seed(seed))
    ours = ADVANTAGES["remax"](AdvantageInputs(data["rewards"], data["mask"], data["groups"],
                                               reward_baselines=baselines), ALGO)
    theirs, _ = verl["compute_remax_outcome_advantage"](data["rewards"].clone(), baselines, data["mask"])
    return ((ours - theirs) * data["mask"]).abs().max().item()


def compare_loss(verl: dict, name: str, data: dict) -> tuple[float, float]:
    kind = POLICY_LOSSES[name]
    loss_agg = kind.loss_agg or "token-mean"
    mask = data["mask"]
    counts = {"tokens": int(mask.sum()), "sequences": mask.shape[0], "horizon": mask.shape[1]}
    ours_logprobs = data["logprobs"].clone().requires_grad_()
    torch.manual_seed(0)
    ours = aggregate(kind.fn(ours_logprobs, data["old"], data["advantages"], mask, ALGO).per_token, mask,
                     loss_agg, counts)
    (ours_grad,) = torch.autograd.grad(ours, ours_logprobs)
    theirs_logprobs = data["logprobs"].clone().requires_grad_()
    torch.manual_seed(0)
    theirs, _ = verl["get_policy_loss_fn"](name)(data["old"], theirs_logprobs, data["advantages"], mask,
                                                 loss_agg_mode=loss_agg, config=verl_actor_config(verl))
    (theirs_grad,) = torch.autograd.grad(theirs, theirs_logprobs)
    return abs(ours.item() - theirs.item()), (ours_grad - theirs_grad).abs().max().item()


REJECTION_THRESHOLDS = {"k1": "0.7_1.4", "k2": "0.05", "k3": "0.05"}


def compare_rejection(verl: dict, option: str, data: dict) -> int:
    log_ratio = data["old"] - data["logprobs"]
    threshold = REJECTION_THRESHOLDS[option[-2:]]
    cfg = RolloutCorrectionConfig(rollout_rs=option, rollout_rs_threshold=threshold)
    lower, upper = rejection_bounds(cfg)[option]
    ours = rejection_keep(log_ratio, data["mask"], option, lower, upper) * data["mask"]
    theirs, _ = verl["compute_rollout_rejection_mask"](log_ratio, data["mask"], option, threshold)
    return int((ours != theirs).sum())


def compare_batch_normalised(verl: dict, level: str, data: dict) -> float:
    """The largest difference of the batch-normalised truncated importance weights, on response tokens."""
    log_ratio, mask = data["old"] - data["logprobs"], data["mask"]
    cfg = RolloutCorrectionConfig(rollout_is=level, rollout_is_threshold=1.5, rollout_is_batch_normalize=True)
    ours, _ = correction_factors(data["old"], data["logprobs"], mask, cfg,
                                 is_weight_mean(data["old"], data["logprobs"], mask, cfg))
    theirs, _ = verl["compute_rollout_correction_weights"](log_ratio, mask, level, 1.5, True)
    return (ours - theirs)[mask.bool()].abs().max().item()


def compare_diagnostics(verl: dict, data: dict) -> dict[str, float]:
    """|ours - VeRL's| of each off-policy diagnostic both compute."""
    mask = data["mask"].bool()
    ours = sequence_mismatch_metrics(data["old"][mask].double(), data["logprobs"][mask].double(),
                                     mask.sum(-1).tolist())
    theirs = verl["compute_offpolicy_metrics"](data["old"].double(), data["logprobs"].double(), data["mask"])
    return {name: abs(ours[f"mismatch/{name}"] - theirs[name]) for name in theirs if f"mismatch/{name}" in ours}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("core_algos", help="VeRL's verl/trainer/ppo/core_algos.py")
    parser.add_argument("--rollout-corr", help="VeRL's verl/trainer/ppo/rollout_corr_helper.py")
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    verl = load_verl(args.core_algos)
    print("| estimator | largest advantage difference |\n|---|---|")
    for name in ESTIMATORS:
        print(f"| {name} | {max(compare_estimator(verl, name, batch(seed)) for seed in range(args.seeds)):.2e} |")
    differ = max(compare_remax(verl, batch(seed), seed) for seed in range(args.seeds))
    print(f"| remax (on response tokens) | {differ:.2e} |")
    for name in TOKEN_BASELINES:
        for weighted in (False, True):
            differ = max(compare_token_baseline(verl, name, batch(seed), seed, weighted) for seed in range(args.seeds))
            print(f"| {name}{' (IS weights)' if weighted else ''} | {differ:.2e} |")
    print("\n| policy loss | largest loss difference | largest gradient difference |\n|---|---|---|")
    for name in LOSSES:
        results = [compare_loss(verl, name, batch(seed)) for seed in range(args.seeds)]
        print(f"| {name} | {max(r[0] for r in results):.2e} | {max(r[1] for r in results):.2e} |")
    if args.rollout_corr:
        corrections = load_verl(args.rollout_corr)
        print("\n| rejection | tokens kept by one, dropped by the other |\n|---|---|")
        for option in DIVERGENCE_REJECTIONS:
            differ = sum(compare_rejection(corrections, option, batch(seed)) for seed in range(args.seeds))
            print(f"| {option} ({REJECTION_THRESHOLDS[option[-2:]]}) | {differ} |")
        print("\n| batch-normalised weights | largest difference |\n|---|---|")
        for level in ("token", "sequence"):
            differ = max(compare_batch_normalised(corrections, level, batch(seed)) for seed in range(args.seeds))
            print(f"| {level} (threshold 1.5) | {differ:.2e} |")
        print("\n| diagnostic | largest difference |\n|---|---|")
        differences = [compare_diagnostics(corrections, batch(seed)) for seed in range(args.seeds)]
        for name in differences[0]:
            print(f"| {name} | {max(d[name] for d in differences):.2e} |")


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
