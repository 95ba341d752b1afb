"""Where the engine/trainer log-prob gap comes from, one factor at a time, on the same tokens.

    python benchmarks/logprob_gap.py --model runs/arith/sft/hf_model --data runs/arith/data/rl_train.parquet

The rollout's vLLM engine (`create_llm`, bf16 on a GPU) samples responses and returns each sampled
token's log-prob, twice: with the logits rounded to the model dtype (vLLM's default) and computed
in fp32 (vLLM's `head_dtype`, what `model.fp32_lm_head` asks for). The trainer
(`RankModel`, one rank, as the RL trainer computes old log-probs) scores the same tokens three
ways: bf16 mixed precision (the default on a GPU), the same with fp32 logits
(`compute_logits_in_fp32`), and full fp32, the exact function up to summation order and the
reference each side's own error is measured against. `--engine-attention TRITON_ATTN` adds an
engine with another attention kernel (vLLM's `attention_backend`, through `rollout.engine_kwargs`;
FlashAttention is a GPU engine's default), sampling its own responses. For each pair it prints the
mean and max |log-prob difference| and the k3 estimate of KL(sampler || scorer) over the response
tokens; `--out FILE` appends them as JSON lines. On CPU the engine computes in fp32, so its gaps to
the fp32 trainer are summation order (~1e-6): a check of the script.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist

HEADS = {"rounded": None, "fp32": torch.float32}
"""The engine's head: logits in the model dtype (vLLM's default), or in fp32."""
TRAINERS = {"bf16": ("bf16", False), "bf16+fp32 head": ("bf16", True), "fp32": ("float32", False)}
"""The trainer's precision: (compute dtype, fp32 logits)."""


def _set_head_dtype(worker, dtype) -> None:
    """Inside the vLLM worker (`collective_rpc`): the dtype its logits processor computes logits in
    (read at each call; None: the model's)."""
    worker.model_runner.get_model().logits_processor.head_dtype = dtype


def sample(model: str, data: str, prompts: int, n: int, max_new_tokens: int, seed: int, attention: str,
           out_path: str) -> None:
    """The engine's process: for each head (the default attention kernel) or the rounded head alone
    (another `attention` backend), the sampled sequences and their log-probs, saved to `out_path`."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams, TokensPrompt

    from rlsys.config.rollout import RolloutConfig
    from rlsys.data.rl import load_prompts
    from rlsys.rollout.vllm_engine import create_llm

    tokenizer = AutoTokenizer.from_pretrained(model)
    rows, _ = load_prompts([data], tokenizer, limit=prompts)
    kernel = {} if attention == "default" else {"attention_backend": attention}
    llm = create_llm(model, RolloutConfig(engine_memory_gib=1.0, engine_kwargs=kernel), seed)
    params = SamplingParams(n=n, temperature=1.0, max_tokens=max_new_tokens, logprobs=0, seed=seed, detokenize=False)
    samples = {}
    for head, dtype in HEADS.items() if attention == "default" else [("rounded", None)]:
        llm.collective_rpc(_set_head_dtype, args=(dtype,))
        outputs = llm.generate([TokensPrompt(prompt_token_ids=row.ids) for row in rows], params, use_tqdm=False)
        samples[head if attention == "default" else f"{head}, {attention}"] = [
            (list(output.prompt_token_ids), list(c.token_ids),
                          [step[token].logprob for step, token in zip(c.logprobs, c.token_ids)])
                         for output in outputs for c in output.outputs]
    torch.save(samples, out_path)


def batch_of(samples: list[tuple]) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """Right-padded rows of prompt + response; the engine's log-probs at the response positions and
    the mask of those positions."""
    width = max(len(p) + len(r) for p, r, _ in samples)
    input_ids = torch.zeros(len(samples), width, dtype=torch.long)
    engine = torch.zeros(len(samples), width)
    response = torch.zeros(len(samples), width, dtype=torch.bool)
    for i, (prompt, tokens, logprobs) in enumerate(samples):
        input_ids[i, :len(prompt) + len(tokens)] = torch.tensor(prompt + tokens)
        engine[i, len(prompt):len(prompt) + len(tokens)] = torch.tensor(logprobs)
        response[i, len(prompt):len(prompt) + len(tokens)] = True
    attention = (torch.arange(width) < torch.tensor([len(p) + len(r) for p, r, _ in samples])[:, None]).long()
    return {"input_ids": input_ids, "attention_mask": attention, "loss_mask": attention.float()}, engine, response


def score(model: str, batch: dict[str, torch.Tensor], compute: str, fp32_head: bool, device: torch.device
          ) -> torch.Tensor:
    """The trainer's log-prob of every token of `batch` (one rank, forward only)."""
    from rlsys.algorithms.lm_loss import token_logprobs
    from rlsys.config.layout import ParallelConfig
    from rlsys.config.model import ModelConfig
    from rlsys.config.training import OptimConfig
    from rlsys.parallel.dims import ParallelDims
    from rlsys.trainer.rank_model import RankModel, RankModelSpec

    parallel = ParallelConfig(dp_shard=1)
    dims = ParallelDims.of(parallel)
    spec = RankModelSpec(ModelConfig(path=model, fp32_lm_head=fp32_head), OptimConfig(), dims, parallel,
                         micro_batch_size=len(batch["input_ids"]), total_steps=1,
                         param_dtype=torch.bfloat16 if compute == "bf16" else None)
    rank_model = RankModel(spec, dims.build_mesh(device.type), device, trainable=False)
    _, rows = rank_model.forward_backward(batch, token_logprobs(), forward_only=True)
    del rank_model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows["logprobs"].float().cpu()


def gap(sampler: torch.Tensor, scorer: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Mean and max |difference| and the k3 estimate of KL(sampler || scorer) over `mask`."""
    log_ratio = (scorer - sampler)[mask].double()
    return {"mean_abs": log_ratio.abs().mean().item(), "max_abs": log_ratio.abs().max().item(),
            "k3_kl": (log_ratio.exp() - 1 - log_ratio).mean().item()}


def start_process_group() -> torch.device:
    on_gpu = torch.cuda.is_available()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("cpu:gloo,cuda:nccl" if on_gpu else "gloo", rank=0, world_size=1,
                            timeout=timedelta(seconds=300))
    return torch.device("cuda", 0) if on_gpu else torch.device("cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="runs/arith/sft/hf_model")
    parser.add_argument("--data", default="runs/arith/data/rl_train.parquet")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="", help="append each pair's figures to this file as JSON lines")
    parser.add_argument("--engine-attention", nargs="*", default=[],
                        help="more engines, each with this vLLM attention backend (e.g. TRITON_ATTN)")
    args = parser.parse_args()
    samples = {}
    with tempfile.TemporaryDirectory() as workdir:
        for attention in ["default", *args.engine_attention]:  # one engine process at a time
            path = os.path.join(workdir, f"{attention}.pt")
            engine = multiprocessing.get_context("spawn").Process(target=sample, args=(
                args.model, args.data, args.prompts, args.n, args.max_new_tokens, args.seed, attention, path))
            engine.start()
            engine.join()
            if engine.exitcode != 0:
                raise SystemExit(f"the vLLM engine's process exited with {engine.exitcode}; its error is above")
            samples.update(torch.load(path))
    device = start_process_group()
    try:
        results = []
        for head, head_samples in samples.items():
            batch, engine_logprobs, response = batch_of(head_samples)
            trainers = {name: score(args.model, batch, *how, device) for name, how in TRAINERS.items()}
            pairs = [(f"engine ({head} logits)", engine_logprobs, name, lp) for name, lp in trainers.items()]
            if head == "rounded":  # the trainer's own error, once
                pairs += [(f"trainer {name}", trainers[name], "fp32", trainers["fp32"]) for name in TRAINERS
                          if name != "fp32"]
            for sampler, sampled, scorer, scored in pairs:
                results.append({"sampler": sampler, "scorer": f"trainer {scorer}", "tokens": int(response.sum()),
                                **gap(sampled, scored, response)})
    finally:
        dist.destroy_process_group()
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (the engine in fp32)"
    print(f"\n[logprob_gap] the log-prob gap on the same response tokens, {name}:")
    print(f"  {'sampled by':<38}{'scored by':<28}{'tokens':>8}{'mean |d|':>10}{'max |d|':>10}{'k3 KL':>10}")
    for row in results:
        print(f"  {row['sampler']:<38}{row['scorer']:<28}{row['tokens']:>8}{row['mean_abs']:>10.2e}"
              f"{row['max_abs']:>10.2e}{row['k3_kl']:>10.2e}")
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps({"check": "logprob_gap", "device": name, **row}) + "\n" for row in results)


if __name__ == "__main__":
    main()
