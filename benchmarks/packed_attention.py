"""Attention over a packed row at long widths, side by side: `--sequences` equal sequences packed
end to end into one row of W tokens (2k, 8k, 32k), the decoder's forward and backward (no LM head,
so attention's share of the work shows), four ways:

- dense mask: the packed row under a [1, 1, W, W] block-causal mask (`block_causal_mask`), as
  packed rows attended before they attended by spans, and as VeRL-style packing without varlen
  kernels would;
- spans: the packed row attended span by span (`rlsys.parallel.span_attention`), as the update
  attends every packed row (on CUDA in bf16: PyTorch's flash variable-length kernel);
- flex: the packed row through transformers' FlexAttention (`attn_implementation="flex_attention"`),
  which reads the packing from the restarting positions and builds a block mask of the documents:
  torchtitan's way (on CUDA; PyTorch has no FlexAttention backward on CPU);
- floor: each sequence a row of its own, causal, no mask: the work the sequences need.

Each (model, width, arm) runs in a process of its own and reports the median seconds of
`--repeats` passes and its peak memory above the loaded model: on CPU the resident memory, the
process's address space capped at `--memory-gib`; on CUDA (`--device cuda`, bf16, where SDPA runs
its flash kernel for causal rows without a mask) the allocator's peak. An arm that does not fit says
so. Models: the random 22.7 M-parameter Qwen2 of the other benchmarks, and SmolLM2-135M cut to its
first 4 decoder layers.

    .venv/bin/python benchmarks/packed_attention.py --widths 2048 8192
    python benchmarks/packed_attention.py --device cuda --widths 8192 32768   # a GPU machine
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

ARMS = ("dense mask", "spans", "flex", "floor")
MODELS = {"random22m": "runs/bench/random22m-v103", "smollm2-4layers": "runs/smollm/model"}


def decoder(model_name: str, device: str, attention: str = "sdpa"):
    """The model's decoder (no LM head) on `device`, in training mode: fp32 on CPU, bf16 on CUDA."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlsys.parallel.span_attention import apply_span_attention

    path = MODELS[model_name]
    if model_name == "random22m":
        from random_model import ensure_random_model

        ensure_random_model(path)
    config = AutoConfig.from_pretrained(path)
    if model_name.startswith("smollm2"):
        config.num_hidden_layers = 4
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype,
                                                 attn_implementation=attention).to(device)
    apply_span_attention(model)
    return model.model.train(), config.vocab_size


def arm_inputs(arm: str, width: int, sequences: int, vocab: int) -> dict:
    """The forward's inputs: `sequences` random sequences of width // sequences tokens, packed into
    one row (dense mask, spans, flex) or one per row (floor)."""
    from rlsys.data.packing import block_causal_mask
    from rlsys.parallel.span_attention import SharedPrefixSpans, span_inputs

    length = width // sequences
    ids = torch.randint(3, vocab, (sequences, length), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(length)
    if arm == "floor":
        return {"input_ids": ids, "position_ids": positions.expand(sequences, -1)}
    segments = torch.arange(1, sequences + 1).repeat_interleave(length)[None]
    packed = {"input_ids": ids.reshape(1, width), "position_ids": positions.repeat(sequences)[None]}
    if arm == "dense mask":
        return {**packed, "attention_mask": block_causal_mask(segments, torch.zeros_like(segments))}
    if arm == "flex":
        return packed
    spans = SharedPrefixSpans.of(segments)
    return {**packed, **span_inputs(spans, 1, width)}


def peak_mib(device: str) -> float:
    """This process's peak memory so far: resident on CPU, allocated on CUDA."""
    if device == "cpu":
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return torch.cuda.max_memory_allocated() / 2**20


def run_one(model_name: str, width: int, arm: str, args) -> dict:
    """One arm in this process: median seconds of `--repeats` forward and backward passes (after one
    unmeasured pass on CUDA), and the peak memory they added to the loaded model's."""
    model, vocab = decoder(model_name, args.device, "flex_attention" if arm == "flex" else "sdpa")
    loaded = peak_mib(args.device)
    inputs = {key: value.to(args.device) for key, value in arm_inputs(arm, width, args.sequences, vocab).items()}

    def step() -> float:
        started = time.perf_counter()
        model(use_cache=False, **inputs).last_hidden_state.float().mean().backward()
        if args.device != "cpu":
            torch.cuda.synchronize()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - started

    if args.device != "cpu":
        step()  # kernels chosen and loaded
    times = [step() for _ in range(args.repeats)]
    return {"seconds": statistics.median(times), "peak_mib": peak_mib(args.device) - loaded}


def measure(model_name: str, width: int, arm: str, args) -> dict:
    """`run_one` in a child process (capped at --memory-gib on CPU); {"error": why} where it does not fit."""
    command = [sys.executable, __file__, "--one", model_name, str(width), arm, "--sequences", str(args.sequences),
               "--repeats", str(args.repeats), "--memory-gib", str(args.memory_gib), "--device", args.device]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        out_of_memory = "MemoryError" in result.stderr or "memory" in result.stderr.lower() or result.returncode < 0
        return {"error": "out of memory" if out_of_memory else result.stderr.strip().splitlines()[-1][:80]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def cell(result: dict) -> str:
    return result["error"] if "error" in result else f"{result['seconds']:.2f} s, {result['peak_mib']:.0f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--widths", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--sequences", type=int, default=8, help="sequences packed into a row")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--memory-gib", type=float, default=16.0, help="each arm's address-space cap on CPU")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--one", nargs=3, metavar=("MODEL", "WIDTH", "ARM"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        if args.device == "cpu":  # CUDA reserves address space far beyond what it uses
            cap = int(args.memory_gib * 2**30)
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        model_name, width, arm = args.one
        print(json.dumps(run_one(model_name, int(width), arm, args)))
        return
    where = (f"CPU, {torch.get_num_threads()} threads, fp32, {args.memory_gib:g} GiB cap" if args.device == "cpu"
             else f"{torch.cuda.get_device_name()}, bf16")
    print(f"[packed_attention] {args.sequences} sequences a row, {where}, medians of {args.repeats}; "
          f"forward and backward seconds, peak memory above the loaded model")
    arms = [arm for arm in args.arms if not (arm == "flex" and args.device == "cpu")]  # PyTorch: forward only
    packed_arms = ARMS[:-1]
    print("| model | row width | " + " | ".join(ARMS) + " | " + " | ".join(f"{arm} / floor" for arm in packed_arms)
          + " |")
    print("|---|---|" + "---|" * (len(ARMS) + len(packed_arms)))
    for model_name in args.models:
        for width in args.widths:
            results = {arm: measure(model_name, width, arm, args) if arm in arms
                       else {"error": "no backward on CPU" if arm in args.arms else "not run"} for arm in ARMS}
            floor = results["floor"].get("seconds")
            ratios = [f"{results[arm]['seconds'] / floor:.2f}" if floor and "seconds" in results[arm] else "-"
                      for arm in packed_arms]
            print(f"| {model_name} | {width} | " + " | ".join(cell(results[arm]) for arm in ARMS) + " | "
                  + " | ".join(ratios) + " |", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
