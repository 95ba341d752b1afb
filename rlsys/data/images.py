"""Images in VeRL's multimodal RL schema: an `images` column of a row's pictures (each a
`{"bytes": ..., "path": ...}` dict as `datasets` stores an Image feature, raw bytes, a file path or a
PIL image), and in the prompt's messages an `<image>` where each picture goes, in order.

A message's content with `<image>` markers becomes Qwen2-VL's list of parts (`{"type": "image"}`
and `{"type": "text", "text": ...}`), which the model's chat template renders as its vision tokens.
"""

from __future__ import annotations

import io
from typing import Any

PLACEHOLDER = "<image>"


def row_images(row: dict) -> list:
    """The pictures of a row's `images` column (`load_images`); none when it has none."""
    return load_images(row["images"]) if row.get("images") is not None else []


def refuse_in_plain_prompt(images: list) -> None:
    """A plain-string prompt has no place for pictures: a ValueError when there are some."""
    if images:
        raise ValueError(f"images: a plain-string prompt has no place for them; give chat messages with {PLACEHOLDER}")


def load_images(column: Any) -> list:
    """The row's pictures as RGB PIL images; a ValueError names the one that cannot be read."""
    from PIL import Image

    pictures = [column] if isinstance(column, (dict, bytes, str)) else list(column or [])
    images = []
    for index, picture in enumerate(pictures):
        try:
            images.append(_open(picture, Image).convert("RGB"))
        except (OSError, ValueError, TypeError, Image.DecompressionBombError) as err:
            raise ValueError(f"images[{index}]: cannot be read as an image ({err})") from None
    return images


def _open(picture: Any, Image):
    if isinstance(picture, Image.Image):
        return picture
    if isinstance(picture, dict):
        data, path = picture.get("bytes"), picture.get("path")
        picture = data if data else path
    if isinstance(picture, bytes):
        return Image.open(io.BytesIO(picture))
    if isinstance(picture, str):
        return Image.open(picture)
    raise TypeError(f"expected bytes, a path or {{'bytes', 'path'}}, got {type(picture).__name__}")


def with_image_parts(messages: list[dict], count: int) -> list[dict]:
    """`messages` with each `<image>` made an image part; a ValueError when the markers are not one
    per picture."""
    markers = sum(m["content"].count(PLACEHOLDER) for m in messages if isinstance(m.get("content"), str))
    if markers != count:
        raise ValueError(f"prompt: {markers} {PLACEHOLDER} markers for {count} images")
    return [{**m, "content": _parts(m["content"])} if isinstance(m.get("content"), str) and PLACEHOLDER in m["content"]
            else m for m in messages]


def _parts(content: str) -> list[dict]:
    parts: list[dict] = []
    for index, text in enumerate(content.split(PLACEHOLDER)):
        if index:
            parts.append({"type": "image"})
        if text:
            parts.append({"type": "text", "text": text})
    return parts
