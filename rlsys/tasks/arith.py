"""Synthetic arithmetic: problems, a verifier, and the three data formats.

A problem is `a op b` with integer operands; the model sees `12+7=` as a user
turn and must answer `19`. Test problems never appear in any training file.

    python -m rlsys.tasks.arith --out examples/arith/data
"""

from __future__ import annotations

import argparse
import os
import random
import re
from dataclasses import dataclass

from rlsys.rewards.registry import register_reward
from rlsys.tasks.files import write_jsonl, write_parquet

DATA_SOURCE = "arith"
_INTEGER = re.compile(r"-?\d+")
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@dataclass(frozen=True)
class Problem:
    a: int
    op: str
    b: int

    @property
    def question(self) -> str:
        return f"{self.a}{self.op}{self.b}="

    @property
    def answer(self) -> str:
        return str(_OPS[self.op](self.a, self.b))


@dataclass(frozen=True)
class ArithSpec:
    max_operand: int = 49
    ops: str = "+-"
    num_test: int = 500
    equations_per_document: int = 8
    pretrain_passes: int = 20
    """Each pass lists every training equation in a fresh random order, so the
    packed windows differ from pass to pass instead of repeating verbatim."""
    sign_slips: float = 0.0
    """A careless teacher's SFT file besides the right one: `sft_careless.jsonl`, where this share of
    the answers to a negative result lose their minus sign, a systematic slip that SFT imitates and
    the verifier in RL does not reward. The pretraining corpus, `sft_train.jsonl`, the RL files and
    the test split keep every sign."""
    seed: int = 0


def split_problems(spec: ArithSpec) -> tuple[list[Problem], list[Problem]]:
    """Every problem of the space, shuffled, cut into disjoint train and test."""
    space = [Problem(a, op, b) for op in spec.ops for a in range(spec.max_operand + 1)
             for b in range(spec.max_operand + 1)]
    random.Random(spec.seed).shuffle(space)
    return space[spec.num_test:], space[: spec.num_test]


@register_reward("arith")
def reward(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """1.0 when the response, stripped, is exactly the problem's integer answer (VeRL's signature)."""
    text = solution_str.strip()
    return float(_INTEGER.fullmatch(text) is not None and int(text) == int(ground_truth))


def pretrain_rows(problems: list[Problem], per_document: int) -> list[dict]:
    lines = [f"{p.question}{p.answer}" for p in problems]
    return [{"text": "\n".join(lines[i:i + per_document])} for i in range(0, len(lines), per_document)]


def sft_rows(problems: list[Problem], sign_slips: float = 0.0, rng: random.Random | None = None) -> list[dict]:
    """Each problem's answer as the response; with `sign_slips`, that share of the negative answers
    (drawn by `rng`) without their minus sign."""
    rng = rng or random.Random(0)
    return [{"prompt": _chat(p), "response": _as_taught(p.answer, sign_slips, rng)} for p in problems]


def _as_taught(answer: str, sign_slips: float, rng: random.Random) -> str:
    return answer[1:] if answer.startswith("-") and rng.random() < sign_slips else answer


def preference_rows(problems: list[Problem], rng: random.Random) -> list[dict]:
    """Preference pairs for a reward model: the right answer chosen over a near miss (off by 1, 2 or 10)."""
    return [{"prompt": _chat(p), "chosen": p.answer,
             "rejected": str(int(p.answer) + rng.choice((-10, -2, -1, 1, 2, 10)))} for p in problems]


def rl_rows(problems: list[Problem], split: str) -> list[dict]:
    """VeRL's RL schema, so VeRL-prepared data and ours read the same way."""
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": _chat(p),
            "ability": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": p.answer},
            "extra_info": {"split": split, "index": i},
        }
        for i, p in enumerate(problems)
    ]


def write_splits(out_dir: str, spec: ArithSpec = ArithSpec()) -> dict[str, str]:
    """Write pretrain/SFT/RL train files (with `spec.sign_slips`, the careless teacher's SFT file too),
    reward-model preference pairs (training problems' and, held out, the test problems') and the
    RL-schema test split."""
    os.makedirs(out_dir, exist_ok=True)
    train, test = split_problems(spec)
    rng = random.Random(spec.seed + 1)
    corpus = [p for _ in range(spec.pretrain_passes) for p in rng.sample(train, len(train))]
    files = {
        "pretrain": write_jsonl(out_dir, "pretrain.jsonl", pretrain_rows(corpus, spec.equations_per_document)),
        "sft": write_jsonl(out_dir, "sft_train.jsonl", sft_rows(train)),
        "rl_train": write_parquet(out_dir, "rl_train.parquet", rl_rows(train, "train")),
        "preferences": write_jsonl(out_dir, "preferences.jsonl", preference_rows(train, rng)),
        "test": write_parquet(out_dir, "test.parquet", rl_rows(test, "test")),
        "preferences_test": write_jsonl(out_dir, "preferences_test.jsonl",
                                        preference_rows(test, random.Random(spec.seed + 2))),
    }
    if spec.sign_slips:
        files["sft_careless"] = write_jsonl(out_dir, "sft_careless.jsonl",
                                            sft_rows(train, spec.sign_slips, random.Random(spec.seed + 3)))
    return files


def _chat(problem: Problem) -> list[dict]:
    return [{"role": "user", "content": problem.question}]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-operand", type=int, default=ArithSpec.max_operand)
    parser.add_argument("--ops", default=ArithSpec.ops)
    parser.add_argument("--num-test", type=int, default=ArithSpec.num_test)
    parser.add_argument("--sign-slips", type=float, default=ArithSpec.sign_slips,
                        help="write sft_careless.jsonl too: this share of its negative answers lose their minus sign")
    parser.add_argument("--seed", type=int, default=ArithSpec.seed)
    args = parser.parse_args(argv)
    spec = ArithSpec(max_operand=args.max_operand, ops=args.ops, num_test=args.num_test, sign_slips=args.sign_slips,
                     seed=args.seed)
    for kind, path in write_splits(args.out, spec).items():
        print(f"{kind:9s} {path}")


if __name__ == "__main__":
    main()
