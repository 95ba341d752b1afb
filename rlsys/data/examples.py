"""Tokenised training examples for pretraining (packed) and SFT (masked).

An example is (input_ids, loss_mask): loss_mask[t] = 1 when token t is a
prediction target (the model predicts it from the tokens before it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rlsys.config.training import DataConfig
from rlsys.data.files import RowStats, convert_rows
from rlsys.data.image_tokens import ImageExpander, ImagePixels, Pictures
from rlsys.data.images import refuse_in_plain_prompt, row_images, with_image_parts


@dataclass
class Example:
    input_ids: list[int]
    loss_mask: list[int]
    pictures: Pictures | None = None
    """A vision-language example's pictures, its image pads expanded for them (`rlsys.data.image_tokens`):
    held as loaded (decoded images), processed into `pixels` for the batches that take the example."""
    pixels: ImagePixels | None = None
    """The pictures processed, as a batch holds them."""


def with_pixels(examples: list[Example], expander: ImageExpander | None) -> list[Example]:
    """`examples` with their pictures processed (`Example.pixels`), for a batch to hold."""
    if expander is None:
        return examples
    return [replace(e, pixels=expander.process(e.pictures)) if e.pictures is not None else e for e in examples]


def load_pretrain_examples(cfg: DataConfig, tokenizer) -> tuple[list[Example], RowStats]:
    """Documents joined with EOS and cut into max_seq_len windows; every token is a target."""
    docs, stats = convert_rows(cfg.train_files, lambda row: _text_field(row, cfg.text_key), "pretrain data")
    stream: list[int] = []
    for ids in tokenizer(docs, add_special_tokens=False)["input_ids"]:
        stream.extend(ids + [tokenizer.eos_token_id])
    n = cfg.max_seq_len
    windows = [stream[i:i + n] for i in range(0, len(stream) - n + 1, n)]
    return [Example(w, [1] * n) for w in windows], stats


def load_sft_examples(cfg: DataConfig, tokenizer, expander: ImageExpander | None = None
                      ) -> tuple[list[Example], RowStats]:
    """Prompt/response or chat rows; only response (assistant) tokens are targets. A vision-language
    model's (`expander`) rows may hold pictures (`rlsys.data.images`)."""

    def convert(row: dict) -> Example:
        example = sft_example(row, cfg, tokenizer, expander)
        if len(example.input_ids) > cfg.max_seq_len:
            raise ValueError(f"{len(example.input_ids)} tokens > data.max_seq_len={cfg.max_seq_len}")
        return example

    return convert_rows(cfg.train_files, convert, "sft data")


def sft_example(row: dict, cfg: DataConfig, tokenizer, expander: ImageExpander | None = None) -> Example:
    tools = row.get(cfg.tools_key) or None
    images = row_images(row)
    if images and expander is None:
        raise ValueError("images: the model is not a vision-language model")
    if cfg.messages_key in row and row[cfg.messages_key] is not None:
        messages = chat_messages(row[cfg.messages_key], cfg.messages_key)
    else:
        prompt, response = row[cfg.prompt_key], _text_field(row, cfg.response_key)
        if isinstance(prompt, str):
            refuse_in_plain_prompt(images)
            return _plain_example(prompt, response, tokenizer)
        messages = chat_messages(prompt, cfg.prompt_key) + [{"role": "assistant", "content": response}]
    if not images:
        return _chat_example(messages, tokenizer, tools)
    example = _chat_example(with_image_parts(messages, len(images)), tokenizer, tools)
    return Example(*expander.expand(example.input_ids, example.loss_mask, images))


def _plain_example(prompt: str, response: str, tokenizer) -> Example:
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return Example(prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids))


def _chat_example(messages: list[dict], tokenizer, tools: list[dict] | None = None) -> Example:
    """Targets are the assistant turns up to their end-of-turn token, found by rendering each
    conversation prefix (with the `tools` schemas, as the agent loop's prompts render them). What the
    template writes after that token (ChatML's newline after `<|im_end|>`) is not a target: the
    engine stops at the end-of-turn token and never samples it.

    Relies on the chat template rendering a prefix of the conversation as a
    prefix of the full text, which holds for the usual templates.
    """
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("conversation has no assistant turn")
    after_end = (turn_end_ids(tokenizer) or [])[1:]
    ids: list[int] = []
    mask: list[int] = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            before = chat_ids(messages[:i], tokenizer, True, tools)
            mask.extend([0] * (len(before) - len(ids)))
            ids = before
        upto = chat_ids(messages[: i + 1], tokenizer, False, tools)
        if upto[: len(ids)] != ids:
            raise ValueError("chat template does not render conversation prefixes as prefixes")
        turn = [int(message["role"] == "assistant")] * (len(upto) - len(ids))
        if turn and turn[0] and after_end and upto[len(upto) - len(after_end):] == after_end:
            turn[len(turn) - len(after_end):] = [0] * len(after_end)
        mask.extend(turn)
        ids = upto
    return Example(ids, mask)


PROBE_CONVERSATION = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]
"""A fixed two-turn conversation whose renderings show what a chat template writes around a turn."""


def turn_end_ids(tokenizer) -> list[int] | None:
    """The template's tokens after an assistant turn's content: its end-of-turn token, then what it
    writes after it (ChatML's newline after `<|im_end|>`). None for a template that does not render
    an assistant turn after its generation prompt."""
    conversation = chat_ids(PROBE_CONVERSATION, tokenizer, add_generation_prompt=False)
    before = chat_ids(PROBE_CONVERSATION[:1], tokenizer, add_generation_prompt=True)
    content = tokenizer(PROBE_CONVERSATION[1]["content"], add_special_tokens=False)["input_ids"]
    if conversation[:len(before) + len(content)] != before + content:
        return None
    return conversation[len(before) + len(content):]


def chat_ids(messages: list[dict], tokenizer, add_generation_prompt: bool, tools: list[dict] | None = None
             ) -> list[int]:
    """`messages` as the chat template renders them (with `tools`), tokenized once: the template
    writes the special tokens, so none are added."""
    if not messages:
        return []
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def conversation_text(tokenizer, messages: list[dict] | None, prompt_text: str, response: str) -> str:
    """A prompt and its response as a reward model reads them: its chat template over the prompt's
    messages and the response as the assistant's turn when it has a template and the prompt has
    messages, else the prompt text followed by the response."""
    if messages is not None and getattr(tokenizer, "chat_template", None):
        turns = [*messages, {"role": "assistant", "content": response}]
        return tokenizer.apply_chat_template(turns, tokenize=False)
    return prompt_text + response


def chat_messages(value, key: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{key!r} must be a non-empty list of {{role, content}} messages")
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{key!r} holds a message without string role and content")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _text_field(row: dict, key: str) -> str:
    value = row[key]
    if not isinstance(value, str):
        raise TypeError(f"{key!r} must be a string, got {type(value).__name__}")
    return value
