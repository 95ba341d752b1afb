"""What packing a vision-language RL batch saves the update, side by side in one run: the forward
and backward of a token-level loss over GRPO groups whose prompts each hold a picture, laid out
three ways: one sample a row, right-padded, each row's picture encoded (what the trainer ran before
these models packed); packed, every sample with its own prompt and picture
(`parallel.share_prompts=false`); packed, each group's prompt and picture laid out and encoded once
(`rlsys.data.packed_pictures`), as the training ranks run it. A random Qwen2-VL of the benchmarks'
22.7 M language model (hidden 512, 8 layers) and a 4-block vision tower of width 512, half of it in
parameters (Qwen2-VL-2B's is 0.68 B beside 1.5 B); each picture 16 x 16 patches, 64 image tokens;
every response of one length, so the padded rows hold no padding and what packing saves is the
prompts and pictures their samples repeat. One process with all threads; medians of repeats, the
three taking turns.

    .venv/bin/python benchmarks/vision_packing.py
    .venv/bin/python benchmarks/vision_packing.py --response 512 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics

import torch
from random_model import RANDOM22M
from update_pass import forward_backward_s

PATCHES = 16
"""A picture's side in patches: (16 / 2) ** 2 = 64 image tokens."""


def vision_model():
    """The random Qwen2-VL, its tokenizer, with span attention and the batch's image positions."""
    from rlsys.models.tiny_vl import TinyVLSpec, build_vl_model, build_vl_tokenizer
    from rlsys.models.vision import place_images_by_batch
    from rlsys.parallel.span_attention import apply_span_attention

    tokenizer = build_vl_tokenizer()
    spec = TinyVLSpec(**{k: v for k, v in RANDOM22M.items() if k != "max_position_embeddings"},
                      vocab_size=len(tokenizer), vision_depth=4, vision_embed_dim=512, vision_heads=8,
                      max_position_embeddings=4096)
    model = build_vl_model(spec, tokenizer)
    place_images_by_batch(model)
    apply_span_attention(model)
    return model, tokenizer


def group_batch(model, tokenizer, prompt_text: int, response: int, groups: int, n: int, seed: int) -> dict:
    """`groups` prompts of `prompt_text` random text tokens around one random picture, each with `n`
    responses of `response` random tokens."""
    from rlsys.data.batching import collate_rollouts
    from rlsys.data.image_tokens import ImagePixels

    vision = model.config.vision_config
    generator = torch.Generator().manual_seed(seed)
    text = lambda length: torch.randint(3, 100, (length,), generator=generator).tolist()  # noqa: E731
    picture_tokens = (PATCHES // vision.spatial_merge_size) ** 2
    patch_values = vision.spatial_merge_size ** 2 * vision.in_channels * vision.temporal_patch_size \
        * vision.patch_size ** 2
    start, end = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
    prompts, pictures = [], []
    for _ in range(groups):
        before = text(prompt_text // 2)
        prompts.append(before + [start] + [model.config.image_token_id] * picture_tokens + [end]
                       + text(prompt_text - prompt_text // 2))
        pictures.append(ImagePixels([len(before) + 1], [picture_tokens], torch.tensor([[1, PATCHES, PATCHES]]),
                                    torch.randn(picture_tokens, patch_values, generator=generator)))
    return collate_rollouts([p for p in prompts for _ in range(n)], [text(response) for _ in range(groups * n)],
                            pad_id=0, prompt_pixels=[p for p in pictures for _ in range(n)])


def layouts(model, batch: dict) -> dict[str, tuple[dict, dict]]:
    """Each way of laying `batch` out: its fields, and its forward's inputs besides input_ids and the
    pictures (`pictures`)."""
    from rlsys.data.packed_pictures import ROPE_POSITIONS, pack_pictured_rows
    from rlsys.parallel.span_attention import SharedPrefixSpans, span_inputs

    out = {"rows, padded": (batch, {"attention_mask": batch["attention_mask"]})}
    for name, share in (("packed, unshared", False), ("packed, shared", True)):
        packed = pack_pictured_rows(batch, share, model).batch
        segments, prefixes = packed["segment_ids"], packed["prefix_ids"]
        out[name] = (packed, {"position_ids": packed[ROPE_POSITIONS].permute(2, 0, 1),
                              **span_inputs(SharedPrefixSpans.of(segments, prefixes), *segments.shape)})
    return out


def pictures(model, fields: dict) -> dict:
    """The forward's picture inputs for `fields`; they also tell the model where its image tokens are,
    so they are made right before each forward."""
    from rlsys.data.image_tokens import GRIDS, IMAGE_TOKENS, PIXELS
    from rlsys.models.vision import image_inputs

    return image_inputs(model, fields[IMAGE_TOKENS], fields[PIXELS], fields[GRIDS], *fields["input_ids"].shape,
                        torch.device("cpu"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-text", type=int, default=32, help="text tokens of a prompt, beside its picture")
    parser.add_argument("--response", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from rlsys.data.image_tokens import GRIDS

    model, tokenizer = vision_model()
    language = sum(p.numel() for p in model.model.language_model.parameters())
    tower = sum(p.numel() for p in model.model.visual.parameters())
    print(f"random Qwen2-VL: language model {language / 1e6:.1f} M, vision tower {tower / 1e6:.1f} M; "
          f"{args.groups} groups x {args.n} samples, a prompt of {args.prompt_text} text tokens and a picture of "
          f"{(PATCHES // 2) ** 2} tokens; {torch.get_num_threads()} threads; forward/backward seconds "
          "(tokens laid out, pictures encoded)")
    for response in args.response:
        batch = group_batch(model, tokenizer, args.prompt_text, response, args.groups, args.n, 0)
        modes = layouts(model, batch)
        if response == args.response[0]:
            print("| response tokens | " + " | ".join(modes) + " | padded / shared |")
            print("|---|" + "---|" * (len(modes) + 1))
        seconds = {name: [] for name in modes}
        for _ in range(args.repeats):
            for name, (fields, inputs) in modes.items():
                seconds[name].append(forward_backward_s(model, fields, **inputs, **pictures(model, fields)))
        medians = {name: statistics.median(times) for name, times in seconds.items()}
        cells = " | ".join(f"{medians[name]:.2f} ({int(fields['attention_mask'].sum())}, "
                           f"{int((fields[GRIDS][..., 0] > 0).sum())})" for name, (fields, _) in modes.items())
        print(f"| {response} | {cells} | **{medians['rows, padded'] / medians['packed, shared']:.2f}x** |", flush=True)


if __name__ == "__main__":
    main()
