"""What laying an agent's shared history out once saves the update, side by side in one run: the
forward and backward of a token-level loss over the segments of multi-turn episodes, each turn its
own segment (what a harness that rewrites the newest tool output, or a serving stack whose
re-rendered history departs from the sampled tokens at each turn's end, gives): segment k is the
prompt, the turns before it (their calls trained in their own segments, here context) and the
k-th call, trained. Packed with nothing shared (`parallel.share_prompts=false`) and as a tree
(every segment's history once, each call once with its own segment's fields), attending span
by span as the training ranks do. One process with all threads; medians of repeats, the two
taking turns.

    .venv/bin/python benchmarks/episode_history.py                      # the random 22.7 M model
    .venv/bin/python benchmarks/episode_history.py --model runs/smollm/model --prompt 256 --call 64 --output 128 \
        --episodes 2 --repeats 1
"""

from __future__ import annotations

import argparse
import statistics

import torch
from update_pass import forward_backward_s, packed_inputs, span_attention_model


def episode_segments(prompt: int, call: int, output: int, turns: int, episodes: int, vocab: int, seed: int):
    """`episodes` episodes of one `prompt`-token prompt, `turns` turns each (a `call`-token call, then an
    `output`-token tool output): a row per turn, its call trained, everything before it context."""
    from rlsys.data.batching import Example, collate

    generator = torch.Generator().manual_seed(seed)
    ids = lambda length: torch.randint(3, vocab, (length,), generator=generator).tolist()  # noqa: E731
    shared_prompt = ids(prompt)
    rows = []
    for _ in range(episodes):
        history = list(shared_prompt)
        for _ in range(turns):
            sampled = ids(call)
            rows.append(Example(history + sampled, [0] * len(history) + [1] * call))
            history += sampled + ids(output)
    return collate(rows, pad_id=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="runs/bench/random22m-v103")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--call", type=int, default=32, help="tokens of each sampled turn")
    parser.add_argument("--output", type=int, default=48, help="tokens of each tool output")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--episodes", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = span_attention_model(args.model)
    batch = episode_segments(args.prompt, args.call, args.output, args.turns, args.episodes, model.config.vocab_size, 0)
    inputs = {"unshared": packed_inputs(batch, False), "tree": packed_inputs(batch, True)}
    seconds = {mode: [] for mode in inputs}
    for _ in range(args.repeats):
        for mode, (packed, forward) in inputs.items():
            seconds[mode].append(forward_backward_s(model, packed, **forward))
    medians = {mode: statistics.median(times) for mode, times in seconds.items()}
    tokens = {mode: int(packed["attention_mask"].sum()) for mode, (packed, _) in inputs.items()}
    print(f"{args.model}: {args.episodes} episodes of a {args.prompt}-token prompt, {args.turns} turns of "
          f"{args.call} sampled + {args.output} tool tokens, a segment a turn; {torch.get_num_threads()} threads")
    print("| | unshared | tree | tree / unshared |\n|---|---|---|---|")
    print(f"| tokens laid out | {tokens['unshared']:,} | {tokens['tree']:,} | "
          f"**{tokens['tree'] / tokens['unshared']:.2f}** |")
    print(f"| forward + backward s | {medians['unshared']:.3f} | {medians['tree']:.3f} | "
          f"**{medians['tree'] / medians['unshared']:.2f}** |", flush=True)


if __name__ == "__main__":
    main()
