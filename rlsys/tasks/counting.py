"""Listing the numbers of a range: a task whose answers are long.

A problem is a range of 100 to 400 consecutive numbers starting at 10..899, asked as a user would:

    user:      List the numbers from 214 to 413, separated by commas.
    assistant: 214, 215, 216, ..., 413

An answer is 5 or 6 tokens a number on SmolLM2's tokenizer (a token a digit, then ", "): 500 to
2,400 tokens, the length of a reasoning trace, on a model small enough to train on a laptop. The
`counting` reward scores the longest run of the range written in order, from its first number,
against the range's length and every number written after the run: an answer that stops early or runs
past the end scores less than one, the whole range alone 1.0.

    python -m rlsys.tasks.counting --out runs/counting/data
"""

from __future__ import annotations

import os
import random
import re
from dataclasses import dataclass

from rlsys.rewards.registry import register_reward
from rlsys.tasks.files import splits_command, write_parquet

DATA_SOURCE = "counting"
_INTEGER = re.compile(r"\d+")


@dataclass(frozen=True)
class CountingSpec:
    min_count: int = 100
    max_count: int = 400
    min_start: int = 10
    max_start: int = 899
    num_rl: int = 2_000
    num_test: int = 100
    seed: int = 0


def problems(spec: CountingSpec) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Distinct (first, last) ranges, training and held out."""
    rng = random.Random(spec.seed)
    ranges: list[tuple[int, int]] = []
    seen = set()
    while len(ranges) < spec.num_test + spec.num_rl:
        first = rng.randint(spec.min_start, spec.max_start)
        last = first + rng.randint(spec.min_count, spec.max_count) - 1
        if (first, last) not in seen:
            seen.add((first, last))
            ranges.append((first, last))
    return ranges[spec.num_test:], ranges[:spec.num_test]


def score(response: str, first: int, last: int) -> float:
    """The longest run first, first + 1, ... written in order, over the range's length plus the numbers
    written after that run (numbers before it, a restated question, cost nothing)."""
    found = [int(number) for number in _INTEGER.findall(response)]
    best, extra = 0, 0
    for start, number in enumerate(found):
        if number != first:
            continue
        run = 0
        while start + run < len(found) and run <= last - first and found[start + run] == first + run:
            run += 1
        if run > best:
            best, extra = run, len(found) - start - run
    count = last - first + 1
    return best / (count + extra)


@register_reward("counting")
def reward(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """VeRL's signature; the ground truth is "first-last"."""
    first, last = map(int, ground_truth.split("-"))
    return score(solution_str, first, last)


def rl_rows(ranges: list[tuple[int, int]], split: str) -> list[dict]:
    """VeRL's RL schema."""
    return [{"data_source": DATA_SOURCE,
             "prompt": [{"role": "user", "content": f"List the numbers from {first} to {last}, separated by commas."}],
             "ability": "counting", "reward_model": {"style": "rule", "ground_truth": f"{first}-{last}"},
             "extra_info": {"split": split, "index": index}} for index, (first, last) in enumerate(ranges)]


def write_splits(out_dir: str, spec: CountingSpec = CountingSpec()) -> dict[str, str]:
    train, test = problems(spec)
    os.makedirs(out_dir, exist_ok=True)
    return {"rl_train": write_parquet(out_dir, "rl_train.parquet", rl_rows(train, "train")),
            "test": write_parquet(out_dir, "test.parquet", rl_rows(test, "test"))}


def main(argv: list[str] | None = None) -> None:
    splits_command(write_splits, __doc__, argv)


if __name__ == "__main__":
    main()
