"""rlsys beside TRL's GRPOTrainer on identical work, with the machine's floor for that step.

    .venv/bin/pip install -e '.[cpu,test,bench]'     # TRL is a benchmark extra only
    .venv/bin/python benchmarks/vs_trl.py --workload arith
    .venv/bin/python benchmarks/vs_trl.py --workload random22m
    .venv/bin/python benchmarks/vs_trl.py --workload smollm   # after examples/smollm/run.sh's SFT stage

One invocation runs, one after the other on the same machine:
  floor  a bare in-process vLLM `generate` of the step's prompts plus one
         single-process forward/backward over the generated batch, padded (as TRL
         runs it), packed, and packed with prompts shared by their samples (as rlsys runs them);
  TRL    GRPOTrainer, one process, HF generate (what a TRL user on CPU gets);
  rlsys  the rlvr step (Ray actors: FSDP2 ranks + a colocated vLLM engine).
Both trainers get the same model directory, the same VeRL-parquet prompts through
the chat template, n samples per prompt, temperature, learning rate (constant),
PPO clip 0.2/0.28, token-mean loss, std-normalised group advantages, no KL and one
update per step. Step times are means over the steps after the first (warm-up).

A workload with a held-out split (`smollm`: the real SmolLM2-135M-Instruct after the example's SFT
warm-up) also measures learning: after the same number of steps with the same settings, each
trainer's final model is scored on the split by the same greedy evaluation (`rlsys eval`), so the
table reads as held-out accuracy per step and per second of training.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass

import torch
from random_model import ensure_random_model
from rlvr_bench import bare_vllm_generate, bench_config, rlsys_steps
from update_pass import forward_backward_s, packed_inputs


@dataclass(frozen=True)
class Workload:
    model: str
    prompts: int
    max_new_tokens: int
    data: str = "runs/arith/data/rl_train.parquet"
    reward: str = "arith"
    test: str = ""
    """A held-out split in the RL schema: both trainers' final models are scored on it."""
    lr: float = 5e-5
    steps: int = 6
    overrides: tuple[str, ...] = ()
    """rlsys settings that change its speed, not what it computes."""


WORKLOADS = {
    # the example's SFT model: short answers, many prompts
    "arith": Workload(model="runs/arith/sft/hf_model", prompts=64, max_new_tokens=8),
    # a random 22.7 M-parameter Qwen2 (hidden 512, 8 layers): long responses, few prompts
    "random22m": Workload(model="runs/bench/random22m-v103", prompts=8, max_new_tokens=128),
    # the real SmolLM2-135M-Instruct after examples/smollm's SFT warm-up, at the example's RL settings
    "smollm": Workload(model="runs/smollm/sft/hf_model", prompts=8, max_new_tokens=16,
                       data="runs/smollm/data/rl_train.parquet", reward="extremes",
                       test="runs/smollm/data/test.parquet", lr=1e-5, steps=20,
                       overrides=("rollout.block_size=32", "rollout.engine_memory_gib=0.5")),
}

@dataclass
class Result:
    step_s: float
    response_tokens: float
    """Mean generated tokens per step."""
    train_s: float = 0.0
    """Seconds from the first step's start to the last step's end."""
    accuracy: float | None = None
    """Held-out accuracy of the final model (a workload with a test split)."""


def floor_step(cfg, prompts) -> tuple[float, float, float, float]:
    """Bare vLLM generate of the prompts, plus one forward/backward over what it generated
    in this process with all threads, on padded rows (as TRL runs it), on the same rows
    packed, and packed with each prompt laid out once for its samples (`rlsys.data.packing`),
    attending by spans as the training ranks do (`rlsys.parallel.span_attention`):
    (generate s, then forward/backward s padded, packed, packed with shared prompts)."""
    from transformers import AutoModelForCausalLM

    from rlsys.data.batching import collate_rollouts
    from rlsys.parallel.span_attention import apply_span_attention

    generate_s, outputs = bare_vllm_generate(cfg, prompts, repeats=3)
    prompt_ids = [ids for (_, ids), out in zip(prompts, outputs) for _ in out.outputs]
    response_ids = [list(c.token_ids) for out in outputs for c in out.outputs]
    padded = collate_rollouts(prompt_ids, response_ids, pad_id=0)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    apply_span_attention(model)
    padded_s = forward_backward_s(model, padded, repeats=3, attention_mask=padded["attention_mask"])
    packed_s = []
    for share_prompts in (False, True):  # as the training ranks pack and attend
        packed, inputs = packed_inputs(padded, share_prompts)
        packed_s.append(forward_backward_s(model, packed, repeats=3, **inputs))
    return generate_s, padded_s, *packed_s


def trl_steps(args, cfg) -> Result:
    from datasets import load_dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlsys.rewards import get_reward

    reward = get_reward(args.reward)

    def task_reward(completions, reward_model, data_source, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [reward(src, text, truth["ground_truth"]) for text, truth, src in zip(texts, reward_model, data_source)]

    class StepClock(TrainerCallback):
        def __init__(self):
            self.ends = [time.perf_counter()]

        def on_step_end(self, *_, **__):
            self.ends.append(time.perf_counter())

    dataset = load_dataset("parquet", data_files=cfg.data.train_files, split="train")
    completions = args.prompts * args.n
    config = GRPOConfig(
        output_dir=os.path.join(args.out, "trl"), use_cpu=True, bf16=False, report_to="none", save_strategy="no",
        logging_steps=1, max_steps=args.steps, seed=cfg.seed, learning_rate=args.lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=cfg.optim.weight_decay, adam_beta1=cfg.optim.betas[0],
        adam_beta2=cfg.optim.betas[1], max_grad_norm=cfg.optim.max_grad_norm,
        per_device_train_batch_size=completions, gradient_accumulation_steps=1, steps_per_generation=1,
        num_generations=args.n, max_completion_length=args.max_new_tokens, temperature=args.temperature,
        top_p=1.0, beta=0.0, num_iterations=1, epsilon=0.2, epsilon_high=0.28, loss_type="dapo",
        scale_rewards="group", disable_dropout=True, dataloader_num_workers=0,
    )
    clock = StepClock()
    trainer = GRPOTrainer(model=cfg.model.path, reward_funcs=task_reward, args=config, train_dataset=dataset,
                          processing_class=AutoTokenizer.from_pretrained(cfg.model.path), callbacks=[clock])
    trainer.train()
    steps = [b - a for a, b in zip(clock.ends, clock.ends[1:])][1:]
    lengths = [row["completions/mean_length"] * completions for row in trainer.state.log_history
               if "completions/mean_length" in row][1:]
    result = Result(statistics.mean(steps), statistics.mean(lengths), clock.ends[-1] - clock.ends[0])
    if args.test:
        trainer.save_model(os.path.join(args.out, "trl", "hf_model"))
        result.accuracy = held_out_accuracy(args, os.path.join(args.out, "trl", "hf_model"), "trl_eval")
    return result


def rlsys_result(args, cfg) -> tuple[Result, dict[str, float], list]:
    rows, prompts, _, _ = rlsys_steps(cfg, export=os.path.join(args.out, "hf_model") if args.test else None)
    measured = rows[1:]
    mean = {k: statistics.mean(r[k] for r in measured) for k in measured[0]}
    tokens = mean["throughput/generated_tokens_per_s"] * mean["time/generate_s"]
    # wall time per trainer.step call, as TRL's clock counts a step: its metrics included
    result = Result(mean["bench/step_wall_s"], tokens, sum(r["bench/step_wall_s"] for r in rows))
    if args.test:
        result.accuracy = held_out_accuracy(args, os.path.join(args.out, "hf_model"), "rlsys_eval")
    return result, mean, prompts


def held_out_accuracy(args, model_dir: str, name: str) -> float:
    """Greedy accuracy of `model_dir` on the workload's test split, by the `eval` stage."""
    from rlsys.config.loader import load_config
    from rlsys.config.schema import EvalJobConfig
    from rlsys.stages.eval import run_eval

    cfg = load_config(EvalJobConfig, None, [
        f"output_dir={os.path.join(args.out, name)}", f"model.path={model_dir}", f"eval.files=[{args.test}]",
        f"eval.reward={args.reward}", f"eval.max_new_tokens={args.max_new_tokens}", "ray.include_dashboard=false"])
    return run_eval(cfg)["accuracy"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="arith")
    parser.add_argument("--data", help="RL prompts (default: the workload's)")
    parser.add_argument("--steps", type=int, help="steps of each trainer (default: the workload's)")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--lr", type=float, help="learning rate (default: the workload's)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--dp", type=int, default=1, help="data-parallel training ranks (each gets cores / dp)")
    parser.add_argument("--out", default="runs/bench/vs_trl")
    parser.add_argument("--skip-trl", action="store_true", help="floor and rlsys only (no TRL installed)")
    parser.add_argument("overrides", nargs="*", help="extra rlsys config overrides (key=value)")
    args = parser.parse_args()
    workload = WORKLOADS[args.workload]
    args.model, args.prompts, args.max_new_tokens = workload.model, workload.prompts, workload.max_new_tokens
    args.reward, args.test = workload.reward, workload.test
    args.data, args.steps, args.lr = args.data or workload.data, args.steps or workload.steps, args.lr or workload.lr
    args.kl_coef = 0.0
    if args.workload == "random22m":
        ensure_random_model(args.model)
    os.makedirs(args.out, exist_ok=True)
    cfg = bench_config(args, [f"optim.lr={args.lr}", "optim.warmup_steps=0", "optim.min_lr_ratio=1.0",
                              f"rollout.temperature={args.temperature}", "algorithm.clip_ratio_low=0.2",
                              "algorithm.clip_ratio_high=0.28", "algorithm.loss_agg=token-mean",
                              "algorithm.norm_adv_by_std=true", f"reward.terms=[{{name: {args.reward}}}]",
                              *workload.overrides, *args.overrides])

    start = held_out_accuracy(args, args.model, "start_eval") if args.test else None
    rlsys, phases, prompts = rlsys_result(args, cfg)
    print(f"rlsys: {rlsys.step_s:.3f} s/step, {rlsys.response_tokens:.0f} response tokens/step", flush=True)
    generate_s, fwd_bwd_s, packed_fwd_bwd_s, shared_fwd_bwd_s = floor_step(cfg, prompts)
    print(f"floor: generate {generate_s:.3f} s + forward/backward {fwd_bwd_s:.3f} s "
          f"({packed_fwd_bwd_s:.3f} s packed, {shared_fwd_bwd_s:.3f} s with shared prompts)", flush=True)
    trl = None if args.skip_trl else trl_steps(args, cfg)

    floor = generate_s + fwd_bwd_s
    print(f"\n{args.workload}: {args.prompts} prompts x n={args.n}, <= {args.max_new_tokens} new tokens, "
          f"{args.steps - 1} measured steps each; {os.cpu_count()} CPUs")
    print(f"{'':<34}{'s/step':>8}{'tokens/step':>13}{'x floor':>9}")
    print(f"{'floor (bare vLLM + 1 fwd/bwd)':<34}{floor:>8.3f}{'':>13}{1:>9.2f}   "
          f"(generate {generate_s:.3f} + fwd/bwd {fwd_bwd_s:.3f})")
    for name, fwd_bwd in (("packed", packed_fwd_bwd_s), ("shared prompts", shared_fwd_bwd_s)):
        print(f"{'floor, ' + name + ' fwd/bwd':<34}{generate_s + fwd_bwd:>8.3f}{'':>13}"
              f"{(generate_s + fwd_bwd) / floor:>9.2f}   (generate {generate_s:.3f} + fwd/bwd {fwd_bwd:.3f})")
    if trl:
        print(f"{'TRL GRPOTrainer (1 process)':<34}{trl.step_s:>8.3f}{trl.response_tokens:>13.0f}"
              f"{trl.step_s / floor:>9.2f}")
    print(f"{'rlsys rlvr':<34}{rlsys.step_s:>8.3f}{rlsys.response_tokens:>13.0f}{rlsys.step_s / floor:>9.2f}   "
          + " ".join(f"{p} {phases[f'time/{p}_s']:.3f}" for p in ("generate", "reward", "old_logprob", "update", "sync")
                     if f"time/{p}_s" in phases))
    if trl:
        print(f"rlsys / TRL step time: {rlsys.step_s / trl.step_s:.2f}")
    if args.test:
        print(f"\nheld-out accuracy (greedy, {args.test}): {start:.1%} at the start; after {args.steps} steps, "
              "and the steps' seconds:")
        for name, result in (("TRL GRPOTrainer", trl), ("rlsys rlvr", rlsys)):
            if result is not None:
                print(f"  {name:<18}{result.accuracy:>8.1%}  in {result.train_s:>7.0f} s")


if __name__ == "__main__":
    main()
