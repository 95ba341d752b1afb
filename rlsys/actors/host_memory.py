"""Giving the host memory a phase freed back to the system.

glibc keeps the blocks a phase frees (logits over the vocabulary, unsharded
layers and their gradients, gathered sync buckets) in its arenas, too
fragmented for the next phase to reuse, so a long-lived actor's resident
memory grows by about its largest phase on top of what it holds. On a
494 M-parameter model (dp_shard=2) a rank kept 1.7 GiB of such blocks between
phases; `malloc_trim` after each phase returns them in a few milliseconds.
Without glibc (macOS) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

_libc_name = ctypes.util.find_library("c")
_malloc_trim = getattr(ctypes.CDLL(_libc_name), "malloc_trim", None) if _libc_name else None


def release_freed_memory() -> None:
    if _malloc_trim is not None:
        _malloc_trim(0)


def releases_freed_memory(method):
    """Decorate an actor method that frees large temporaries."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        finally:
            release_freed_memory()

    return wrapper
