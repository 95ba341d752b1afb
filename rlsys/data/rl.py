"""Prompts in VeRL's RL schema: data_source, prompt (chat list or string),
reward_model.ground_truth, extra_info, and for a vision-language model images (with `<image>`
in the prompt where each goes: `rlsys.data.images`). VeRL-prepared parquet reads unchanged,
and ground truths and extra info reach the reward functions as stored."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from rlsys.data.examples import chat_messages
from rlsys.data.files import RowStats, convert_rows
from rlsys.data.image_tokens import ImageExpander
from rlsys.data.images import refuse_in_plain_prompt, row_images, with_image_parts


@dataclass
class Prompt:
    text: str
    """The prompt as the model sees it (chat template applied)."""
    ids: list[int]
    """`text` tokenized (no special tokens added: the chat template has them)."""
    ground_truth: Any
    """reward_model.ground_truth as stored: a string, number, list or dict."""
    data_source: str
    extra_info: Any = None
    """extra_info as stored (usually a dict; None when the row has none)."""
    messages: list[dict] | None = None
    """The prompt's chat messages (None for a plain-string prompt): a reward model or a judge
    renders them in its own chat template."""
    images: list | None = None
    """A vision-language prompt's pictures (PIL images), in the order its image tokens come."""
    engine_tokens: int = 0
    """The prompt's length in an engine: `ids` with each picture's token expanded to its count."""

    @property
    def row(self) -> dict:
        """What an agent loop sees of the row: the prompt (its messages, else its text), data_source,
        extra_info (where `tools_kwargs` sits) and any images; the ground truth is the reward's alone."""
        return {"prompt": self.messages if self.messages is not None else self.text,
                "data_source": self.data_source, "extra_info": self.extra_info,
                **({"images": self.images} if self.images else {})}


def load_prompts(paths: list[str], tokenizer, max_tokens: int | None = None, limit: int = 0,
                 tools: list[dict] | None = None, expander: ImageExpander | None = None
                 ) -> tuple[list[Prompt], RowStats]:
    """The prompts of `paths`; a row whose prompt is longer than `max_tokens` is skipped and
    counted (`prompt_budget`), as VeRL filters overlong prompts. `tools`: OpenAI function
    schemas the chat template renders into chat prompts (`tools=`). `expander`: a
    vision-language model's, which counts a prompt's image tokens as the engine expands them and
    skips a row with more pictures than a prompt may hold."""
    prompts, stats = convert_rows(paths, lambda row: to_prompt(row, tokenizer, max_tokens, tools, expander),
                                  "rl data")
    return (prompts[:limit] if limit else prompts), stats


def prompt_budget(model_path: str, response_tokens: int) -> int | None:
    """The longest prompt that leaves `response_tokens` (all of a response's turns) in the model's
    context (its config's max_position_embeddings, vLLM's context length): a longer one would fail
    the whole rollout or have its response cut short. None when the config states no context length."""
    from transformers import AutoConfig

    context = getattr(AutoConfig.from_pretrained(model_path).get_text_config(), "max_position_embeddings", None)
    return context - response_tokens if context else None


def to_prompt(row: dict, tokenizer, max_tokens: int | None = None, tools: list[dict] | None = None,
              expander: ImageExpander | None = None) -> Prompt:
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        raise ValueError("missing reward_model.ground_truth")
    prompt, messages = row["prompt"], None
    images = row_images(row)
    if not isinstance(prompt, str):
        messages = chat_messages(to_python(prompt), "prompt")
        if images:
            messages = with_image_parts(messages, len(images))
        prompt = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                               add_generation_prompt=True)
    else:
        refuse_in_plain_prompt(images)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    length = expander.expanded_length(ids, images) if images and expander is not None else len(ids)
    if max_tokens is not None and length > max_tokens:
        raise ValueError(f"prompt of {length} tokens, over the {max_tokens} that leave room for the response "
                         "in the model's context")
    return Prompt(
        text=prompt,
        ids=ids,
        ground_truth=to_python(reward_model["ground_truth"]),
        data_source=str(row.get("data_source") or ""),
        extra_info=to_python(row.get("extra_info")),
        messages=messages,
        images=images or None,
        engine_tokens=length,
    )


def to_python(value: Any) -> Any:
    """Plain Python values for what a parquet reader may hand over: numpy scalars and
    arrays become numbers and lists, nested structs stay dicts, all the way down."""
    if isinstance(value, dict):
        return {key: to_python(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [to_python(item) for item in value]
    if isinstance(value, np.generic):
        return value.item()
    return value
