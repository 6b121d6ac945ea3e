"""keep_freed_memory: psring's own processes reuse freed heap memory instead of faulting in fresh pages."""

from __future__ import annotations

import subprocess
import sys

import pytest

from psring.core.arrays import keep_freed_memory

# Arrays whose size changes every step (a sparse step's rows): each allocation a few MiB, freed at once.
SCRIPT = """
import resource, sys
import numpy as np
from psring.core.arrays import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory(256 << 20)
def step(i):
    # several live at once, sizes new each time, each written through (the shard's merge, update, replies)
    held = [np.ones((5 << 20) + 4096 * ((i + k) % 7), np.uint8) for k in range(8)]
    return sum(int(a[-1]) for a in held)
for i in range(10):
    step(i)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(200):
    step(i)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's mallopt: Linux only")
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_freed_memory_is_reused_without_page_faults():
    default, kept = _faults("default"), _faults("keep")
    # by default glibc trims the heap once the step's 40 MiB are freed: ~10,000 page faults a step
    assert default > 200 * 2000, default
    assert kept < 200 * 50, (kept, default)


def test_zero_leaves_the_allocator_alone():
    assert keep_freed_memory(0) is False
