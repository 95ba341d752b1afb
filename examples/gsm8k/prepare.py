"""GSM8K from the Hub (openai/gsm8k, `main`) in VeRL's RL schema, as VeRL's
examples/data_preprocess/gsm8k.py writes it: the question with VeRL's instruction as a one-turn chat
prompt, the number after "####" as reward_model.ground_truth, data_source "openai/gsm8k". The
`gsm8k` reward scores a response by the last "#### <number>" in it.

    python examples/gsm8k/prepare.py --out data/gsm8k      # train.parquet (7,473) and test.parquet (1,319)

Downloads through `datasets` (HF_ENDPOINT, HF_HOME and HF_TOKEN as you set them); offline, it reads
the copy your cache holds, and says so in one line when it holds none.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
DATA_SOURCE = "openai/gsm8k"
_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


def to_row(example: dict, split: str, index: int) -> dict:
    """One problem in VeRL's schema."""
    found = _ANSWER.search(example["answer"])
    if found is None:
        raise ValueError(f"{split} row {index}: no '#### <number>' in its answer")
    return {"data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"{example['question']} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": found.group(1).replace(",", "")},
            "extra_info": {"split": split, "index": index, "answer": example["answer"],
                           "question": example["question"]}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/gsm8k", help="directory for train.parquet and test.parquet")
    args = parser.parse_args(argv)
    import datasets

    from rlsys.config.loader import first_line

    try:
        splits = datasets.load_dataset(DATA_SOURCE, "main")
    except Exception as error:  # no network, no cached copy, a proxy's refusal: one line, whatever the client raised
        print(f"examples/gsm8k/prepare.py: cannot read {DATA_SOURCE} from the Hub or the cache: {first_line(error)}",
              file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    for split in ("train", "test"):
        rows = [to_row(example, split, index) for index, example in enumerate(splits[split])]
        path = os.path.join(args.out, f"{split}.parquet")
        datasets.Dataset.from_list(rows).to_parquet(path)
        print(f"{split:5s} {len(rows):5d} rows  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
