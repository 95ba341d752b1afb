"""What laying a GRPO group's prompt out once saves the update, side by side in one run: the
forward and backward of a token-level loss over the same RL batch packed three ways, at
prompt:response token ratios 1:4, 1:1 and 4:1, n samples a prompt: with every sample's prompt
(`parallel.share_prompts=false`); with each group's prompt once under a dense block-causal mask
(attention over each row's whole width); and with each group's prompt once, attending span by
span, as the training ranks run it (`rlsys.parallel.span_attention`). One process with all
threads; medians of repeats, the three taking turns.

    .venv/bin/python benchmarks/shared_prefix.py                      # the random 22.7 M model
    .venv/bin/python benchmarks/shared_prefix.py --model runs/smollm/model --groups 2
"""

from __future__ import annotations

import argparse
import statistics

import torch
from update_pass import forward_backward_s, packed_inputs, span_attention_model

RATIOS = ((1, 4), (1, 1), (4, 1))


def group_batch(prompt_len: int, response_len: int, groups: int, n: int, vocab: int, seed: int):
    """`groups` prompts of `prompt_len` random tokens, each with `n` responses of `response_len`."""
    from rlsys.data.batching import collate_rollouts

    generator = torch.Generator().manual_seed(seed)
    ids = lambda length: torch.randint(3, vocab, (length,), generator=generator).tolist()  # noqa: E731
    prompts = [ids(prompt_len) for _ in range(groups)]
    return collate_rollouts([p for p in prompts for _ in range(n)], [ids(response_len) for _ in range(groups * n)],
                            pad_id=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="runs/bench/random22m-v103")
    parser.add_argument("--tokens", type=int, default=160, help="prompt + response tokens of a sample")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model = span_attention_model(args.model)
    modes = {"unshared": (False, True), "shared, dense mask": (True, False), "shared, span attention": (True, True)}
    print(f"{args.model}: {args.groups} groups x {args.n} samples of {args.tokens} tokens, "
          f"{torch.get_num_threads()} threads; forward/backward seconds (packed tokens)")
    print("| prompt + response | " + " | ".join(modes) + " | unshared / span attention |")
    print("|---|" + "---|" * (len(modes) + 1))
    for prompt_part, response_part in RATIOS:
        prompt_len = args.tokens * prompt_part // (prompt_part + response_part)
        batch = group_batch(prompt_len, args.tokens - prompt_len, args.groups, args.n, model.config.vocab_size, 0)
        inputs = [packed_inputs(batch, share, spans) for share, spans in modes.values()]
        seconds = [[] for _ in modes]
        for _ in range(args.repeats):
            for times, (packed, forward) in zip(seconds, inputs):
                times.append(forward_backward_s(model, packed, **forward))
        medians = [statistics.median(times) for times in seconds]
        cells = " | ".join(f"{s:.3f} ({packed['attention_mask'].sum()})" for s, (packed, _) in zip(medians, inputs))
        print(f"| {prompt_len} + {args.tokens - prompt_len} | {cells} | **{medians[0] / medians[-1]:.2f}** |",
              flush=True)


if __name__ == "__main__":
    main()
