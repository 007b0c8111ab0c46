"""How a worker's C heap hands freed memory back to the operating system (glibc malloc).

PyTorch's CPU tensors come from ``malloc``. glibc serves a block below its *mmap threshold* from
a heap, where a freed block stays mapped for reuse, and a block at or above it from a fresh
mapping that ``free`` returns at once. By default the threshold adapts upwards as large blocks are
freed, and a heap gives back what is free at its top once that passes the *trim threshold* (twice
the mmap threshold); a thread other than the main one gets an arena of its own, whose extra 64 MiB
heaps are unmapped as soon as they are wholly free.

A worker computes in such a thread, and each step allocates and frees its activations again: with
glibc's defaults a W2 trainer gave its freed heap back and took page faults for it again every step
(6,500 a step, each page zero-filled by the kernel). :func:`keep_freed_memory` (every worker, at
start) keeps that memory mapped: one arena for all threads, blocks up to 32 MiB from it, and no
trimming below 1 GiB of free top. The worker's peak resident size is what its steps need, as
before; it stays there between steps instead of falling and faulting back. docs/benchmarks.md §44.

A low fixed mmap threshold (``stages.train.options.mmap_threshold_bytes``) goes the other way: every
block at or above it is mapped and unmapped, which costs page faults (time) and saves the heap's
fragmentation (memory).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

log = logging.getLogger("streamrl.host_memory")

# glibc's mallopt parameter numbers (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MAX_MMAP_THRESHOLD = 32 * 2**20  # glibc's HEAP_MAX_SIZE / 2 on 64-bit: mallopt refuses more
# Free memory a heap keeps at its top (keep_freed_memory): far above a step's activations at the
# sizes a CPU trains (W2's trainer frees ~30 MiB a step), bounded so that a one-off burst of small
# blocks does not stay resident for the rest of the run
KEPT_FREE_BYTES = 2**30


class HostMemoryError(RuntimeError):
    """The C library refused the setting."""


def _mallopt() -> Any:
    """glibc's ``mallopt``, or None where the C library has none (musl, macOS)."""
    # the symbols already loaded in this process, libc's among them: no library search (find_library
    # runs ldconfig in a subprocess)
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def keep_freed_memory() -> bool:
    """Keep the memory this process frees mapped for its next allocations: every thread on the main
    arena (``M_ARENA_MAX`` 1: a compute thread's arena would unmap its extra heaps whenever they
    empty), blocks below :data:`MAX_MMAP_THRESHOLD` from it (the most the adaptive threshold would
    reach, fixed from the start), and up to :data:`KEPT_FREE_BYTES` of free memory at its top kept.
    Call it before the process starts its threads. Returns False where the C library is not glibc,
    after a warning; raises :class:`HostMemoryError` if glibc refuses a value."""
    mallopt = _mallopt()
    if mallopt is None:
        log.warning("this C library has no mallopt (not glibc): freed memory is returned as it decides")
        return False
    for param, value in ((M_ARENA_MAX, 1), (M_MMAP_THRESHOLD, MAX_MMAP_THRESHOLD), (M_TRIM_THRESHOLD, KEPT_FREE_BYTES)):
        if mallopt(param, value) != 1:
            raise HostMemoryError(f"glibc refused mallopt({param}, {value})")
    return True


def set_mmap_threshold(nbytes: int) -> bool:
    """Serve every ``malloc`` of at least ``nbytes`` from its own mapping, returned to the OS on
    ``free`` (``mallopt(M_MMAP_THRESHOLD)``, which also turns off glibc's adaptive threshold).

    Returns False where the C library is not glibc (no ``mallopt``: musl, macOS), after a warning;
    raises :class:`HostMemoryError` if glibc refuses the value.
    """
    if not 0 < nbytes <= MAX_MMAP_THRESHOLD:
        raise ValueError(f"mmap threshold must be in 1..{MAX_MMAP_THRESHOLD} bytes, got {nbytes}")
    mallopt = _mallopt()
    if mallopt is None:
        log.warning("this C library has no mallopt (not glibc): the mmap threshold of %d bytes is not set", nbytes)
        return False
    if mallopt(M_MMAP_THRESHOLD, nbytes) != 1:
        raise HostMemoryError(f"glibc refused mallopt(M_MMAP_THRESHOLD, {nbytes})")
    return True
