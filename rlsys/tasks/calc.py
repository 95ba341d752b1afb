"""Products of 3-digit numbers with a calculator: a task a tiny model cannot do in its head.

A problem is `a*b=` with two operands of 100..999; the answer has five or six digits. A
tool-use trace calls the calculator with the expression and answers with its result:

    user:      123*456=
    assistant: <tool_call>{"name": "calculator", "arguments": {"expression": "123*456"}}</tool_call>
    tool:      56088
    assistant: 56088

The fine-tuning traces come from a demonstrator who calls the calculator on a third of the
problems and answers the others at once (the right product, worked out in their head): a model
imitating them answers most problems in its head, and wrongly, while the traces that call the
tool teach it to copy the result. RL with the tool in the loop has to learn that calling it pays.

`calc` (the reward) scores the final assistant turn: the whole of it must be the product.
Test problems never appear in any training file. The fine-tuning traces carry the
calculator's schema (`tools`), which the chat template renders as the tool loop's prompts do.

    python -m rlsys.tasks.calc --out runs/calc/data
"""

from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass

import rlsys.tools  # noqa: F401  (registers the calculator)
from rlsys.rewards.registry import register_reward
from rlsys.tasks.files import splits_command

DATA_SOURCE = "calc"
_INTEGER = re.compile(r"-?\d+")


@dataclass(frozen=True)
class CalcSpec:
    low: int = 100
    high: int = 999
    num_sft: int = 1200
    """Traces to fine-tune on."""
    tool_share: float = 0.33
    """The share of fine-tuning traces that call the calculator; the others answer at once (the
    right product, as a demonstrator who works it out in their head): a model imitating those
    cannot, and RL with the tool has to learn that calling it pays."""
    num_rl: int = 20_000
    num_test: int = 500
    seed: int = 0


def tool_call(a: int, b: int) -> str:
    arguments = json.dumps({"name": "calculator", "arguments": {"expression": f"{a}*{b}"}})
    return f"<tool_call>{arguments}</tool_call>"


def problems(spec: CalcSpec) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Disjoint training and test problems."""
    rng = random.Random(spec.seed)
    seen, ordered = set(), []
    while len(ordered) < spec.num_rl + spec.num_sft + spec.num_test:
        pair = (rng.randint(spec.low, spec.high), rng.randint(spec.low, spec.high))
        if pair not in seen:
            seen.add(pair)
            ordered.append(pair)
    return ordered[spec.num_test:], ordered[:spec.num_test]


def messages(a: int, b: int, with_tool: bool = True) -> list[dict]:
    question = {"role": "user", "content": f"{a}*{b}="}
    if not with_tool:
        return [question, {"role": "assistant", "content": str(a * b)}]
    return [question, {"role": "assistant", "content": tool_call(a, b)},
            {"role": "tool", "content": str(a * b)}, {"role": "assistant", "content": str(a * b)}]


@register_reward("calc")
def reward(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """1.0 when the final assistant turn (the tool loop's `final_turn`, else the response) is exactly
    the product (VeRL's signature)."""
    final = extra_info.get("final_turn", solution_str) if isinstance(extra_info, dict) else solution_str
    text = final.strip()
    return float(_INTEGER.fullmatch(text) is not None and int(text) == int(ground_truth))


def rl_rows(pairs: list[tuple[int, int]], split: str) -> list[dict]:
    return [{"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": f"{a}*{b}="}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(a * b)},
             "extra_info": {"split": split, "index": i}} for i, (a, b) in enumerate(pairs)]


def write_splits(out_dir: str, spec: CalcSpec = CalcSpec()) -> dict[str, str]:
    from rlsys.tools.registry import load_tools

    train, test = problems(spec)
    sft, rl = train[:spec.num_sft], train[spec.num_sft:]
    os.makedirs(out_dir, exist_ok=True)
    paths = {name: os.path.join(out_dir, file) for name, file in
             (("sft", "sft_train.jsonl"), ("rl_train", "rl_train.parquet"), ("test", "test.parquet"))}
    tools = [spec_.schema for spec_ in load_tools(["calculator"], "")]
    with_tool = set(random.Random(spec.seed + 1).sample(range(len(sft)), round(spec.tool_share * len(sft))))
    with open(paths["sft"], "w") as f:
        f.writelines(json.dumps({"messages": messages(a, b, i in with_tool), "tools": tools}) + "\n"
                     for i, (a, b) in enumerate(sft))
    import datasets

    datasets.Dataset.from_list(rl_rows(rl, "train")).to_parquet(paths["rl_train"])
    datasets.Dataset.from_list(rl_rows(test, "test")).to_parquet(paths["test"])
    return paths


def main(argv: list[str] | None = None) -> None:
    splits_command(write_splits, __doc__, argv)


if __name__ == "__main__":
    main()
