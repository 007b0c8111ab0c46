"""streamrl.runtime.host_memory against glibc itself, in fresh interpreters (the allocator's state is
per process): a fixed mmap threshold maps a block that glibc's adaptive threshold would have served
from the heap."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from streamrl.runtime.host_memory import MAX_MMAP_THRESHOLD, set_mmap_threshold

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

# Frees a 4 MiB block (mapped: above the initial 128 KiB threshold, which it then raises to 4 MiB),
# then holds a 2 MiB one and reports how many mapped blocks glibc has (mallinfo2's hblks).
PROBE = """
import ctypes, json, sys
from streamrl.runtime.host_memory import set_mmap_threshold
if sys.argv[1] != "none":
    assert set_mmap_threshold(int(sys.argv[1]))
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = MallInfo2
before = libc.mallinfo2().hblks
libc.free(libc.malloc(4 << 20))
block = libc.malloc(2 << 20)
print(json.dumps({"mapped": libc.mallinfo2().hblks - before}))
libc.free(block)
"""


def _mapped_after(threshold: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, threshold], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    return int(json.loads(out.strip().splitlines()[-1])["mapped"])


def test_a_fixed_threshold_maps_the_blocks_the_adaptive_one_keeps_in_the_heap() -> None:
    assert _mapped_after("none") == 0  # glibc raised its threshold to 4 MiB: the 2 MiB block is heap
    assert _mapped_after(str(1 << 20)) == 1  # fixed at 1 MiB: mapped, and returned to the OS when freed


def test_values_glibc_would_refuse_are_refused_first() -> None:
    for bad in (0, -1, MAX_MMAP_THRESHOLD + 1):
        with pytest.raises(ValueError, match=r"mmap threshold must be in 1\.\."):
            set_mmap_threshold(bad)
