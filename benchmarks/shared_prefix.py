"""What laying a GRPO group's prompt out once saves the update, side by side in one run: the
forward and backward of a token-level loss over the same RL batch packed three ways, at
prompt:response token ratios 1:4, 1:1 and 4:1, n samples a prompt: with every sample's prompt
(`parallel.share_prompts=false`), with each group's prompt once for all its samples, and as the
training ranks pack it (`rlsys.data.packing`: the chunk of samples sharing a prompt copy that
the model's `ShareCost` finds cheapest). One process with all threads; medians of repeats.

    .venv/bin/python benchmarks/shared_prefix.py                      # the random 22.7 M model
    .venv/bin/python benchmarks/shared_prefix.py --model runs/smollm/base --tokens 160
"""

from __future__ import annotations

import argparse
import statistics

import torch
from vs_trl import ensure_random_model, forward_backward_s

RATIOS = ((1, 4), (1, 1), (4, 1))


def group_batch(prompt_len: int, response_len: int, groups: int, n: int, vocab: int, seed: int):
    """`groups` prompts of `prompt_len` random tokens, each with `n` responses of `response_len`."""
    from rlsys.data.batching import collate_rollouts

    generator = torch.Generator().manual_seed(seed)
    ids = lambda length: torch.randint(3, vocab, (length,), generator=generator).tolist()  # noqa: E731
    prompts = [ids(prompt_len) for _ in range(groups)]
    return collate_rollouts([p for p in prompts for _ in range(n)], [ids(response_len) for _ in range(groups * n)],
                            pad_id=0)


def update_s(model, batch, shares: list, repeats: int) -> list[tuple[float, int, int]]:
    """For each packing of `batch` (`pack_rows` with each of `shares`): its forward/backward
    seconds (the median of `repeats`, the packings taking turns so that the machine's drift
    reaches them alike), its packed tokens (padding included) and its widest row."""
    from rlsys.data.packing import block_causal_mask, pack_rows

    packed = [pack_rows(batch, share).batch for share in shares]
    inputs = [(p, block_causal_mask(p["segment_ids"], p["prefix_ids"]), p["position_ids"]) for p in packed]
    seconds = [[] for _ in shares]
    for _ in range(repeats):
        for times, args in zip(seconds, inputs):
            times.append(forward_backward_s(model, *args, repeats=1))
    return [(statistics.median(times), p["input_ids"].numel(), p["input_ids"].shape[1])
            for times, p in zip(seconds, packed)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="runs/bench/random22m-v103")
    parser.add_argument("--tokens", type=int, default=160, help="prompt + response tokens of a sample")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from rlsys.data.packing import ShareCost

    if args.model.endswith("random22m-v103"):
        ensure_random_model(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    packings = {"unshared": None, "whole groups": ShareCost(), "rlsys (ShareCost)": ShareCost.of(model.config)}
    print(f"{args.model}: {args.groups} groups x {args.n} samples of {args.tokens} tokens, "
          f"{torch.get_num_threads()} threads; seconds (packed tokens, widest row)")
    print("| prompt + response | " + " | ".join(packings) + " | unshared / rlsys |")
    print("|---|" + "---|" * (len(packings) + 1))
    for prompt_part, response_part in RATIOS:
        prompt_len = args.tokens * prompt_part // (prompt_part + response_part)
        batch = group_batch(prompt_len, args.tokens - prompt_len, args.groups, args.n, model.config.vocab_size, 0)
        results = update_s(model, batch, list(packings.values()), args.repeats)
        cells = " | ".join(f"{s:.3f} ({tokens}, {width})" for s, tokens, width in results)
        print(f"| {prompt_len} + {args.tokens - prompt_len} | {cells} | **{results[0][0] / results[-1][0]:.2f}** |",
              flush=True)

if __name__ == "__main__":
    main()
