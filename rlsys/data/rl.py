"""Prompts in VeRL's RL schema: data_source, prompt (chat list or string),
reward_model.ground_truth, extra_info. VeRL-prepared parquet reads unchanged."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlsys.data.examples import chat_messages
from rlsys.data.files import RowStats, convert_rows


@dataclass
class Prompt:
    text: str
    """The prompt as the model sees it (chat template applied)."""
    ground_truth: str
    data_source: str
    extra_info: dict = field(default_factory=dict)


def load_prompts(paths: list[str], tokenizer, limit: int = 0) -> tuple[list[Prompt], RowStats]:
    prompts, stats = convert_rows(paths, lambda row: to_prompt(row, tokenizer), "rl data")
    return (prompts[:limit] if limit else prompts), stats


def to_prompt(row: dict, tokenizer) -> Prompt:
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        raise ValueError("missing reward_model.ground_truth")
    prompt = row["prompt"]
    if not isinstance(prompt, str):
        prompt = tokenizer.apply_chat_template(chat_messages(prompt, "prompt"), tokenize=False,
                                               add_generation_prompt=True)
    return Prompt(
        text=prompt,
        ground_truth=str(reward_model["ground_truth"]),
        data_source=str(row.get("data_source") or ""),
        extra_info=dict(row.get("extra_info") or {}),
    )
