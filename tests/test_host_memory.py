"""Actors give freed host memory back only when there is enough of it to matter."""

import subprocess
import sys

import pytest

from rlsys.host_memory import freed_bytes_held

pytestmark = pytest.mark.quick  # the quick tier (scripts/test.sh --quick)

# Frees 64 MiB in 64 KiB blocks (below glibc's mmap threshold, so they stay in the arena)
# below a block still held (so free() cannot shrink the heap's top), then asks for a trim.
CHURN = """
import sys, torch
from rlsys.host_memory import release_freed_memory
def resident(): return int(open("/proc/self/statm").read().split()[1]) * 4096
blocks = [torch.ones(16 * 1024) for _ in range(1024)]
held = torch.ones(16 * 1024)
del blocks
before = resident()
release_freed_memory(min_bytes=int(sys.argv[1]))
print((before - resident()) / 2**20)
"""


def returned_mib(min_bytes: int) -> float:
    out = subprocess.run([sys.executable, "-c", CHURN, str(min_bytes)], capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


@pytest.mark.skipif(freed_bytes_held() is None, reason="needs glibc >= 2.33")
def test_a_trim_returns_the_freed_blocks_only_above_its_threshold():
    assert returned_mib(min_bytes=32 * 2**20) > 48
    assert returned_mib(min_bytes=256 * 2**20) < 4


# Holds 512 MiB resident, frees it, then reads the peak twice: the step that held it, then the next.
PEAK = """
import torch
from rlsys.host_memory import resident_peak_bytes
resident_peak_bytes()
held = torch.ones(128 * 2**20)
del held
print(resident_peak_bytes() / 2**20, resident_peak_bytes() / 2**20)
"""


def test_the_resident_peak_is_each_steps_own():
    """A rank's `perf/max_memory_resident_gib` on CPU: the peak since the last read, not since the start."""
    out = subprocess.run([sys.executable, "-c", PEAK], capture_output=True, text=True, check=True)
    with_block, after = map(float, out.stdout.split()[-2:])
    assert with_block > after + 448, (with_block, after)
