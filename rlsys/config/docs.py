"""Markdown tables of every config key, generated from the field docstrings.

    python -m rlsys.config.docs     # the tables docs/configuration.md embeds
"""

from __future__ import annotations

import dataclasses
import typing

from rlsys.config.schema import EvalJobConfig, PipelineConfig, RLJobConfig, TrainJobConfig

SCHEMAS = {"pretrain / sft": TrainJobConfig, "rlvr": RLJobConfig, "eval": EvalJobConfig,
           "pipeline": PipelineConfig}


def config_rows(schema: type, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, description) for every leaf key of `schema`."""
    rows = []
    hints = typing.get_type_hints(schema)
    for field in dataclasses.fields(schema):
        key = prefix + field.name
        nested = _nested_dataclass(hints[field.name])
        if nested is not None:
            is_list = typing.get_origin(hints[field.name]) is list
            rows.extend(config_rows(nested, key + ("[]." if is_list else ".")))
            continue
        description = _description(schema, field.name)
        default = schema.__pydantic_fields__[field.name].get_default(call_default_factory=True)
        rows.append((key, _type_name(hints[field.name]), _format_default(default), description))
    return rows


def markdown() -> str:
    parts = []
    for stage, schema in SCHEMAS.items():
        parts.append(f"#### `{stage}`\n\n| key | type | default | meaning |\n|---|---|---|---|")
        parts.extend(f"| `{k}` | {t} | {d} | {m} |" for k, t, d, m in config_rows(schema))
        parts.append("")
    return "\n".join(parts)


def _description(schema: type, name: str) -> str:
    """The field's docstring; pydantic keeps it only on the class that declares the field."""
    for cls in schema.__mro__:
        info = getattr(cls, "__pydantic_fields__", {}).get(name)
        if info is not None and info.description:
            return " ".join(info.description.split())  # one table row
    return ""


def _nested_dataclass(annotation) -> type | None:
    candidates = [annotation, *typing.get_args(annotation)]
    return next((c for c in candidates if dataclasses.is_dataclass(c)), None)


def _type_name(annotation) -> str:
    text = str(annotation).replace("typing.", "")
    return text.replace("|", "\\|").replace("<class '", "").replace("'>", "")


def _format_default(value) -> str:
    return '`""`' if value == "" else f"`{value}`"


if __name__ == "__main__":
    print(markdown())
