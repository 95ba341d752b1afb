"""Read local JSONL / Parquet files through `datasets`, row errors named."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rlsys.config.loader import ConfigError

if TYPE_CHECKING:
    import datasets

log = logging.getLogger(__name__)

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


class DataError(ValueError):
    """Input data that cannot be read; the message names the file and row."""


@dataclass
class RowStats:
    """How many rows were kept and skipped, and why the first was skipped."""

    kept: int = 0
    skipped: int = 0
    first_reason: str = ""
    by_file: dict[str, int] = field(default_factory=dict)

    def skip(self, path: str, row: int, reason: str) -> None:
        self.skipped += 1
        self.by_file[path] = self.by_file.get(path, 0) + 1
        if not self.first_reason:
            self.first_reason = f"{path} row {row}: {reason}"

    def report(self, what: str) -> None:
        if self.skipped:
            log.warning("%s: skipped %d of %d rows (first: %s)", what, self.skipped,
                        self.kept + self.skipped, self.first_reason)


def read_rows(paths: list[str]) -> Iterator[tuple[str, int, dict]]:
    """Yield (file, row number from 1, row) for every row of every file."""
    for path in paths:
        for i, row in enumerate(load_file(path)):
            yield path, i + 1, row


def load_file(path: str) -> datasets.Dataset:
    """`datasets` is imported here, not at the top: the trainer imports this module
    (through batching) and must import where `datasets` is not installed (the GPU check)."""
    import datasets

    builder = _BUILDERS.get(os.path.splitext(path)[1].lower())
    if builder is None:
        raise DataError(f"{path}: unsupported file type (use .jsonl, .json or .parquet)")
    try:
        return datasets.load_dataset(builder, data_files=path, split="train")
    except Exception as err:  # datasets/pyarrow raise many types; name the row where we can
        raise DataError(_locate_bad_row(path, builder) or f"{path}: cannot be read ({err})") from None


def convert_rows(paths: list[str], convert: Callable[[dict], object], what: str) -> tuple[list, RowStats]:
    """Apply `convert` to every row; a row it rejects with ValueError/KeyError/TypeError is skipped and counted."""
    stats, out = RowStats(), []
    for path, row_number, row in read_rows(paths):
        try:
            out.append(convert(row))
            stats.kept += 1
        except (ValueError, KeyError, TypeError) as err:
            stats.skip(path, row_number, str(err))
    if not out:
        raise DataError(f"{what}: no usable rows in {', '.join(paths)} ({stats.first_reason or 'files are empty'})")
    stats.report(what)
    return out, stats


def _locate_bad_row(path: str, builder: str) -> str | None:
    if builder != "json":
        return None
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as err:
                return f"{path} row {number}: not valid JSON ({err.msg})"
            if not isinstance(value, dict):
                return f"{path} row {number}: expected a JSON object, got {type(value).__name__}"
    return None


def check_files(paths: list[str], key: str) -> None:
    """Each of a key's files exists (one at least)."""
    if not paths:
        raise ConfigError(f"{key}: at least one file is required")
    for i, path in enumerate(paths):
        if not os.path.isfile(path):
            raise ConfigError(f"{key}[{i}]: file not found: {path}")
