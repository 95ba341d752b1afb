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
