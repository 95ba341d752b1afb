"""Preference pairs for reward-model training (the `rm` stage): a prompt (a string or a chat list)
with a chosen and a rejected response, each rendered as the reward model will read it when it
scores (`conversation_text`). A pair is two examples, chosen then rejected, whose loss mask marks
the last token alone: the position whose value is the reward model's score."""

from __future__ import annotations

from rlsys.config.training import DataConfig
from rlsys.data.examples import Example, chat_messages, conversation_text
from rlsys.data.files import RowStats, convert_rows


def load_preference_pairs(cfg: DataConfig, tokenizer, files: list[str] | None = None
                          ) -> tuple[list[tuple[Example, Example]], RowStats]:
    """The (chosen, rejected) examples of every row of `files` (default: the training files); a row
    with a response over max_seq_len tokens, or whose responses are equal, is skipped and counted."""
    return convert_rows(cfg.train_files if files is None else files, lambda row: preference_pair(row, cfg, tokenizer),
                        "preference data")


def preference_pair(row: dict, cfg: DataConfig, tokenizer) -> tuple[Example, Example]:
    prompt = row[cfg.prompt_key]
    messages = None if isinstance(prompt, str) else chat_messages(prompt, cfg.prompt_key)
    if messages is not None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{cfg.prompt_key!r} is a chat list, and the model's tokenizer has no chat template")
    prompt_text = prompt if messages is None else ""
    chosen, rejected = (_response(row, key) for key in (cfg.chosen_key, cfg.rejected_key))
    if chosen == rejected:
        raise ValueError(f"{cfg.chosen_key!r} and {cfg.rejected_key!r} are the same response")
    pair = tuple(_scored_example(tokenizer, conversation_text(tokenizer, messages, prompt_text, response))
                 for response in (chosen, rejected))
    longest = max(len(e.input_ids) for e in pair)
    if longest > cfg.max_seq_len:
        raise ValueError(f"{longest} tokens > data.max_seq_len={cfg.max_seq_len}")
    return pair


def _scored_example(tokenizer, text: str) -> Example:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return Example(ids, [0] * (len(ids) - 1) + [1])


def _response(row: dict, key: str) -> str:
    value = row[key]
    if not isinstance(value, str):
        raise TypeError(f"{key!r} must be a string, got {type(value).__name__}")
    return value
