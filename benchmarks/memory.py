"""Per-rank memory of a training layout: bytes of parameters, gradients and optimizer
state each rank holds, and the peak memory of loading the model and of one training
step, for a random-init Qwen2-shaped model, or with --experts a Qwen3-MoE one; with
--lora-rank, LoRA adapters on every linear layer, the base frozen.

    .venv/bin/python benchmarks/memory.py --layout dp_shard=2 --layout tp=2 --layout dp_shard=2,tp=2
    .venv/bin/python benchmarks/memory.py --experts 8 --layout dp_shard=2 --layout dp_shard=2,ep=2
    .venv/bin/python benchmarks/memory.py --lora-rank 16 --layout dp_shard=1 --hidden 896 ...   # beside rank 0

With --experts, each layout's step time is also measured, side by side, for the dense model of
the same active parameters per token (an MLP as wide as the top-k experts together; ep dropped).

Each layout runs in its own gloo process group (torch.multiprocessing, no Ray: the
rank's model does not need it). The `ideal` column is the model's total bytes divided
by the ranks that split it (dp_shard x cp x tp x pp; pipeline stages split by layer, so
the stage with the embedding or the LM head holds more); `vs ideal` is the rank's parameter bytes
against it. Peak memory is the bytes tensors hold above what they held before the model was
built (torch's allocator's count: what the planner estimates), and on the CPU the process's
resident set beside it (the host memory it took; `rlsys.planner.measure`).
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile

import torch

from rlsys.planner.measure import StepShape, measure

GIB = 2**30


def peak(row: dict, window: str) -> str:
    """Tensor bytes, and on the CPU the process's resident set beside them, in MiB."""
    resident = row[f"{window}_resident"]
    return f"{row[f'{window}_peak'] / 2**20:.0f}" + ("" if resident is None else f" / {resident / 2**20:.0f}")


def write_model(out_dir: str, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
                vocab: int, tied: bool, experts: int = 0, top_k: int = 2) -> int:
    """A random-init Qwen2 model directory (weights and config only), or with `experts` a
    Qwen3-MoE one whose experts are `intermediate` wide; returns its parameter count."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3MoeConfig

    common = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, intermediate_size=intermediate, vocab_size=vocab,
                  tie_word_embeddings=tied, max_position_embeddings=4096)
    if experts:
        config = Qwen3MoeConfig(**common, head_dim=hidden // heads, num_experts=experts, num_experts_per_tok=top_k,
                                moe_intermediate_size=intermediate, norm_topk_prob=True)
    else:
        config = Qwen2Config(**common)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir)
    return sum(p.numel() for p in model.parameters())


def parse_layout(text: str) -> dict:
    return {key: int(value) for key, value in (item.split("=") for item in text.split(","))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", action="append", type=parse_layout,
                        help="e.g. dp_shard=2,tp=2 (repeatable; default: dp_shard=2, tp=2, dp_shard=2,tp=2)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rows", type=int, default=4, help="rows per data-parallel rank")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=0, help="rows per micro-batch (default: --rows)")
    parser.add_argument("--tied", action="store_true", help="tie the embedding and the LM head")
    parser.add_argument("--steps", type=int, default=1, help="training steps; the last one is measured")
    parser.add_argument("--experts", type=int, default=0, help="a Qwen3-MoE model with this many experts a layer")
    parser.add_argument("--top-k", type=int, default=2, help="with --experts: experts per token")
    parser.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank (0: train every weight)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: one GPU per rank, nccl")
    parser.add_argument("--mmap-threshold-kb", type=int, default=0,
                        help="MALLOC_MMAP_THRESHOLD_ of the rank processes: glibc maps every block of this "
                             "size or more on its own and unmaps it when freed (0: glibc's default)")
    args = parser.parse_args()
    layouts = args.layout or [{"dp_shard": 2}, {"tp": 2}, {"dp_shard": 2, "tp": 2}]
    step = StepShape(args.rows, args.seq_len, args.steps, args.micro_batch, args.lora_rank, args.device)
    if args.mmap_threshold_kb:  # read by glibc when each rank process starts
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold_kb * 1024)
    with tempfile.TemporaryDirectory() as model_dir:
        intermediate = args.intermediate // args.top_k if args.experts else args.intermediate
        count = write_model(model_dir, args.hidden, args.layers, args.heads, args.kv_heads, intermediate,
                            args.vocab, args.tied, args.experts, args.top_k)
        total = count * 4
        kind = f"Qwen3-MoE, {args.experts} experts of width {intermediate}, top-{args.top_k}" if args.experts \
            else "Qwen2"
        kind += f", LoRA rank {args.lora_rank} on every linear layer" if args.lora_rank else ""
        print(f"model: {kind}, {count / 1e6:.1f} M parameters, {total / GIB:.3f} GiB in fp32; "
              f"batch {args.rows} x {args.seq_len} tokens per data-parallel rank, step {args.steps} measured\n")
        print("| layout | rank | params MiB | grads MiB | optimizer MiB | ideal MiB | vs ideal "
              "| load peak MiB tensors / process | step peak MiB tensors / process | step s |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        step_s = {}
        for layout in layouts:
            shards = math.prod(layout.get(name, 1) for name in ("dp_shard", "cp", "tp", "pp"))
            name = layout_name(layout)
            rows = measure(layout, model_dir, step)
            step_s[name] = max(row["step_s"] for row in rows)
            for rank, row in enumerate(rows):
                print(f"| {name} | {rank} | {row['params'] / 2**20:.1f} | {row['grads'] / 2**20:.1f} "
                      f"| {row['optim'] / 2**20:.1f} | {total / shards / 2**20:.1f} "
                      f"| {row['params'] / (total / shards):.3f} | {peak(row, 'load')} | {peak(row, 'step')} "
                      f"| {row['step_s']:.2f} |")
    if args.experts:
        compare_dense(args, step, layouts, step_s)


def layout_name(layout: dict) -> str:
    return " x ".join(f"{k}={v}" for k, v in layout.items())


def compare_dense(args, step: StepShape, layouts: list[dict], moe_step_s: dict[str, float]) -> None:
    """Step time of each layout against the dense model of the same active parameters per token."""
    with tempfile.TemporaryDirectory() as model_dir:
        active = write_model(model_dir, args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate,
                             args.vocab, args.tied)
        print(f"\ndense model of the same active parameters: {active / 1e6:.1f} M parameters\n")
        print("| layout | MoE step s | dense step s | MoE / dense |")
        print("|---|---|---|---|")
        for layout in layouts:
            dense_layout = {k: v for k, v in layout.items() if k != "ep"}
            dense_s = max(row["step_s"] for row in measure(dense_layout, model_dir, step))
            moe_s = moe_step_s[layout_name(layout)]
            print(f"| {layout_name(layout)} | {moe_s:.2f} | {dense_s:.2f} | {moe_s / dense_s:.2f} |")


if __name__ == "__main__":
    main()
