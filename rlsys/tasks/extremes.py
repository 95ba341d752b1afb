"""The largest or smallest number of a short list: a task a small pretrained model half knows.

A problem is a list of 4 to 6 distinct numbers of 1..99 and a question about it, asked in
plain words as a user would:

    user:      What is the largest number in this list: 12, 85, 33, 47? Answer with the number only.
    assistant: 85

`extremes` (the reward) scores the last integer of the response, so an answer in a sentence
("The largest number is 85.") counts as a user would count it. SmolLM2-135M-Instruct answers
this right some of the time and most of its problems right at least once in 8 samples: RL has
something to sharpen, and held-out lists never appear in any training file.

    python -m rlsys.tasks.extremes --out runs/smollm/data
"""

from __future__ import annotations

import os
import random
import re
from dataclasses import dataclass

from rlsys.rewards.registry import register_reward
from rlsys.tasks.files import splits_command, write_jsonl, write_parquet

DATA_SOURCE = "extremes"
_INTEGER = re.compile(r"-?\d+")
KINDS = {"largest": max, "smallest": min}


@dataclass(frozen=True)
class Problem:
    kind: str
    numbers: tuple[int, ...]

    @property
    def question(self) -> str:
        listed = ", ".join(map(str, self.numbers))
        return f"What is the {self.kind} number in this list: {listed}? Answer with the number only."

    @property
    def answer(self) -> str:
        return str(KINDS[self.kind](self.numbers))


@dataclass(frozen=True)
class ExtremesSpec:
    min_length: int = 4
    max_length: int = 6
    max_number: int = 99
    num_rl: int = 20_000
    num_sft: int = 200
    """Worked examples for an optional SFT warm-up (`sft_train.jsonl`), disjoint from the RL prompts."""
    num_test: int = 300
    seed: int = 0


def problems(spec: ExtremesSpec) -> tuple[list[Problem], list[Problem]]:
    """Distinct training and held-out problems: a list never appears in both (in any order, for either kind)."""
    rng = random.Random(spec.seed)
    seen, ordered = set(), []
    while len(ordered) < spec.num_test + spec.num_sft + spec.num_rl:
        numbers = tuple(rng.sample(range(1, spec.max_number + 1), rng.randint(spec.min_length, spec.max_length)))
        if frozenset(numbers) not in seen:
            seen.add(frozenset(numbers))
            ordered.append(Problem(rng.choice(sorted(KINDS)), numbers))
    return ordered[spec.num_test:], ordered[:spec.num_test]


@register_reward("extremes")
def reward(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """1.0 when the response's last integer is the answer (VeRL's signature)."""
    found = _INTEGER.findall(solution_str)
    return float(bool(found) and int(found[-1]) == int(ground_truth))


def rl_rows(problems_: list[Problem], split: str) -> list[dict]:
    """VeRL's RL schema."""
    return [{"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": p.question}], "ability": "lists",
             "reward_model": {"style": "rule", "ground_truth": p.answer},
             "extra_info": {"split": split, "index": i, "kind": p.kind}} for i, p in enumerate(problems_)]


def sft_rows(problems_: list[Problem]) -> list[dict]:
    return [{"messages": [{"role": "user", "content": p.question}, {"role": "assistant", "content": p.answer}]}
            for p in problems_]


def write_splits(out_dir: str, spec: ExtremesSpec = ExtremesSpec()) -> dict[str, str]:
    train, test = problems(spec)
    sft, rl = train[:spec.num_sft], train[spec.num_sft:]
    os.makedirs(out_dir, exist_ok=True)
    return {"sft": write_jsonl(out_dir, "sft_train.jsonl", sft_rows(sft)),
            "rl_train": write_parquet(out_dir, "rl_train.parquet", rl_rows(rl, "train")),
            "test": write_parquet(out_dir, "test.parquet", rl_rows(test, "test"))}


def main(argv: list[str] | None = None) -> None:
    splits_command(write_splits, __doc__, argv)


if __name__ == "__main__":
    main()
