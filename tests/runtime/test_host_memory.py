"""streamrl.runtime.host_memory against glibc itself, in fresh interpreters (the allocator's state is
per process): a fixed mmap threshold maps a block that glibc's adaptive threshold would have served
from the heap; keep_freed_memory keeps what a thread frees mapped for its next step."""

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


# A thread's "steps": each allocates 96 MiB in 2 MiB blocks (more than one 64 MiB heap of a thread's
# arena), writes every page, frees them all; reports each step's page faults in that thread.
STEPS = """
import ctypes, json, resource, sys, threading
from streamrl.runtime.host_memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
faults = []
def steps():
    for _ in range(4):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        blocks = [libc.malloc(2 << 20) for _ in range(48)]
        for b in blocks:
            libc.memset(b, 1, 2 << 20)
        for b in blocks:
            libc.free(b)
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
t = threading.Thread(target=steps)
t.start()
t.join()
print(json.dumps({"faults": faults}))
"""


def _step_faults(mode: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    return [int(n) for n in json.loads(out.strip().splitlines()[-1])["faults"]]


def test_freed_memory_is_kept_for_the_next_step() -> None:
    pages = 96 * 2**20 // 4096
    default, kept = _step_faults("none"), _step_faults("keep")
    assert kept[0] > pages // 2  # the first step maps its memory either way
    assert all(n < 64 for n in kept[1:]), kept  # then reuses it
    # glibc's defaults unmap the thread's second heap once it is free: every step faults it back
    assert sum(default[1:]) > pages // 4, default

