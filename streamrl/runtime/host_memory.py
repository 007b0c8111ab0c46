"""How a worker's C heap hands freed memory back to the operating system (glibc malloc).

PyTorch's CPU tensors come from ``malloc``. glibc serves a block below its *mmap threshold* from
the heap, where a freed block stays mapped for reuse, and a block at or above it from a fresh
mapping that ``free`` returns at once. The threshold adapts upwards as large blocks are freed, so
after a few steps a trainer's activations (blocks of about batch x tokens x hidden x 4 bytes) all
come from the heap: fast to reuse, but the heap's fragmentation raises the peak resident size over
what is live at any moment. A fixed threshold stops the adaptation: every block at or above it is
mapped and unmapped, which costs page faults (time) and saves that fragmentation (memory).
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("streamrl.host_memory")

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
MAX_MMAP_THRESHOLD = 32 * 2**20  # glibc's HEAP_MAX_SIZE / 2 on 64-bit: mallopt refuses more


class HostMemoryError(RuntimeError):
    """The C library refused the setting."""


def set_mmap_threshold(nbytes: int) -> bool:
    """Serve every ``malloc`` of at least ``nbytes`` from its own mapping, returned to the OS on
    ``free`` (``mallopt(M_MMAP_THRESHOLD)``, which also turns off glibc's adaptive threshold).

    Returns False where the C library is not glibc (no ``mallopt``: musl, macOS), after a warning;
    raises :class:`HostMemoryError` if glibc refuses the value.
    """
    if not 0 < nbytes <= MAX_MMAP_THRESHOLD:
        raise ValueError(f"mmap threshold must be in 1..{MAX_MMAP_THRESHOLD} bytes, got {nbytes}")
    # the symbols already loaded in this process, libc's among them: no library search (find_library
    # runs ldconfig in a subprocess)
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        log.warning("this C library has no mallopt (not glibc): the mmap threshold of %d bytes is not set", nbytes)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, nbytes) != 1:
        raise HostMemoryError(f"glibc refused mallopt(M_MMAP_THRESHOLD, {nbytes})")
    return True
