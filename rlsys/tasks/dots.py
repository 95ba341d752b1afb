"""The vision-language example's task: how many dots a picture holds.

Each picture is 56 x 56 pixels, white, with 1 to `max_dots` black dots in distinct cells of a
2 x 2 grid, each jittered in its cell; the prompt is `<image>dots=` and the answer the count,
scored by the `arith` reward (the response must be exactly that integer). Nothing in the text
tells the counts apart: the answer needs the picture.

    python -m rlsys.tasks.dots --out runs/vlm/data
"""

from __future__ import annotations

import argparse
import io
import os
import random
from dataclasses import dataclass

SIZE, CELLS, RADIUS = 56, 2, 8


@dataclass(frozen=True)
class DotsSpec:
    max_dots: int = 4
    num_train: int = 4000
    num_test: int = 256
    seed: int = 0


def picture(count: int, rng: random.Random) -> bytes:
    """A PNG of `count` dots in distinct cells."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), "white")
    draw = ImageDraw.Draw(image)
    cell = SIZE // CELLS
    for index in rng.sample(range(CELLS * CELLS), count):
        x = (index % CELLS) * cell + rng.randint(RADIUS, cell - RADIUS)
        y = (index // CELLS) * cell + rng.randint(RADIUS, cell - RADIUS)
        draw.ellipse([x - RADIUS + 1, y - RADIUS + 1, x + RADIUS - 1, y + RADIUS - 1], fill="black")
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _question() -> list[dict]:
    return [{"role": "user", "content": "<image>dots="}]


def write_splits(out_dir: str, spec: DotsSpec = DotsSpec()) -> dict[str, str]:
    """SFT conversations and RL prompts of their own pictures, and a held-out test split, as parquet
    in VeRL's multimodal schema (an `images` column of PNG bytes)."""
    from datasets import Dataset

    rng = random.Random(spec.seed)
    os.makedirs(out_dir, exist_ok=True)

    def rows(count: int, split: str, with_answer: bool) -> list[dict]:
        made = []
        for _ in range(count):
            dots = rng.randint(1, spec.max_dots)
            row = {"images": [{"bytes": picture(dots, rng), "path": None}]}
            if with_answer:
                row["messages"] = _question() + [{"role": "assistant", "content": str(dots)}]
            else:
                row.update(data_source="dots", prompt=_question(), reward_model={"ground_truth": str(dots)},
                           extra_info={"split": split})
            made.append(row)
        return made

    files = {"sft_train": rows(spec.num_train, "train", True), "rl_train": rows(spec.num_train, "train", False),
             "test": rows(spec.num_test, "test", False)}
    paths = {}
    for name, split in files.items():
        paths[name] = os.path.join(out_dir, f"{name}.parquet")
        Dataset.from_list(split).to_parquet(paths[name])
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    for kind, path in write_splits(parser.parse_args(argv).out).items():
        print(f"{kind:9s} {path}")


if __name__ == "__main__":
    main()
