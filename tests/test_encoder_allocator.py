"""The encoder's allocator tuning: memory a forward pass frees is reused, not page-faulted back."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Starts processes of its own (see the tiers in tests/conftest.py).
pytestmark = pytest.mark.integration

# Allocates, writes and frees a 64 MB block twice in a fresh interpreter; prints the page faults the
# second allocation took. 64 MB is over glibc's largest mmap threshold (32 MB): by default it is
# mmapped, unmapped on free, and every one of its 16384 pages faults in again.
_PROBE = """
import ctypes, resource, sys
from encoder_service.allocator import retain_freed_memory
applied = retain_freed_memory() if sys.argv[1] == "retain" else False
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def faults_of_one_pass():  # as torch's CPU allocator does: malloc, write every byte, free
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(64 << 20)
    ctypes.memset(block, 1, 64 << 20)
    libc.free(block)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults_of_one_pass()
print(applied, faults_of_one_pass())
"""


def _second_pass_faults(mode: str) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True).stdout
    applied, faults = out.split()
    return applied == "True", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning")
def test_retained_memory_is_reused_without_page_faults() -> None:
    applied, retained = _second_pass_faults("retain")
    _, default = _second_pass_faults("default")
    assert applied
    assert default > 10_000  # the default gives the pages back and faults them in again
    assert retained < 1_000
