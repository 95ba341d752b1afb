"""Giving the host memory a phase freed back to the system.

glibc keeps the blocks a phase frees (logits over the vocabulary, unsharded
layers and their gradients, sync buckets) in its arenas, too fragmented for
the next phase to reuse, so a long-lived actor's resident memory grows by about
its largest phase on top of what it holds. `malloc_trim` after a phase returns
them in a few milliseconds.

Trimming has a price: the next phase faults those pages in again. So an actor
method trims only when its arenas hold at least `TRIM_ABOVE_BYTES` free, which
bounds what it keeps (docs/performance.md has the measurements). Without glibc
(macOS) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import inspect

TRIM_ABOVE_BYTES = 256 * 2**20

_libc_name = ctypes.util.find_library("c")
_libc = ctypes.CDLL(_libc_name) if _libc_name else None
_malloc_trim = getattr(_libc, "malloc_trim", None)
_mallinfo2 = getattr(_libc, "mallinfo2", None)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


if _mallinfo2 is not None:
    _mallinfo2.restype = _MallInfo2


def freed_bytes_held() -> int | None:
    """Bytes free in glibc's arenas (None without glibc >= 2.33). An upper bound on what a
    trim returns: free blocks a trim already gave back still count."""
    return _mallinfo2().fordblks if _mallinfo2 is not None else None


def release_freed_memory(min_bytes: int = 0) -> None:
    """Return the arenas' free pages to the system, if they hold at least `min_bytes` free."""
    if _malloc_trim is None:
        return
    held = freed_bytes_held() if min_bytes else None
    if held is None or held >= min_bytes:
        _malloc_trim(0)


def releases_freed_memory(method):
    """Decorate an actor method (a coroutine function too) that frees large temporaries."""

    if inspect.iscoroutinefunction(method):
        @functools.wraps(method)
        async def awaiting(*args, **kwargs):
            try:
                return await method(*args, **kwargs)
            finally:
                release_freed_memory(TRIM_ABOVE_BYTES)

        return awaiting

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        finally:
            release_freed_memory(TRIM_ABOVE_BYTES)

    return wrapper


def resident_peak_bytes() -> int | None:
    """The most memory this process held resident since the last call: Linux's high-water mark (VmHWM),
    reset for the next call through /proc/self/clear_refs; since the process started where the kernel
    refuses the reset; None without /proc."""
    try:
        with open("/proc/self/status") as f:
            peak_kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # 5: reset the high-water mark to the current resident set
    except OSError:
        pass
    return peak_kib * 1024
