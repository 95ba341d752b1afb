"""Named entries of one kind, added by decorators and chosen in config: reward
functions, advantage estimators, policy losses."""

from __future__ import annotations

import inspect
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str, entry: T) -> T:
        """Add `entry` under `name`; registering the same entry again is fine: a module imported twice,
        or run as a script (`python -m rlsys.tasks.arith`) beside its package's import of it."""
        if name in self._entries and not _same(self._entries[name], entry):
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = entry
        return entry

    def __getitem__(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; registered: {', '.join(self.names())}") from None

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return sorted(self._entries)


def _same(registered, entry) -> bool:
    """The same object, or the same definition (name and file) executed again."""
    if registered is entry or registered == entry:
        return True
    try:
        return (registered.__qualname__, inspect.getfile(registered)) == (entry.__qualname__, inspect.getfile(entry))
    except (AttributeError, TypeError):
        return False
