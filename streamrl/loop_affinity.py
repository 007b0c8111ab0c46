"""A process's event-loop thread and its ZeroMQ I/O threads kept on one core.

A message between two processes of a run wakes three threads: the sender's ZeroMQ I/O thread
(woken by the sending thread), the receiver's I/O thread (by the socket) and the receiving event
loop (by its I/O thread). Where the kernel places each wake-up on whichever core looks free, a
wake-up often lands behind another process's compute thread, or on an idle virtual CPU that the
host must first wake: a round trip between two processes took 84 µs on a quiet 2-core host and a
median 100 µs, one in ten over 2 ms, beside two bursty compute loads; with each process's loop
thread and I/O thread on one core of their own it took 80 µs and 66 µs, one in ten over 80 µs
(docs/benchmarks.md §39). Compute threads stay on every core the process may use: the threads
that a pinned thread starts inherit its core, so a compute thread gives itself every core back
(:func:`release_this_thread`) before it computes.

Linux only (``os.sched_setaffinity``); elsewhere every function does nothing.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

_SUPPORTED = hasattr(os, "sched_setaffinity") and hasattr(os, "sched_getaffinity")
_all_cores: set[int] | None = None  # the cores the process could use before its loop was pinned
_released = threading.local()  # a thread that gave itself every core back (release_this_thread)


def cores() -> list[int]:
    """The cores this thread may run on, in order (empty where affinity is not supported)."""
    return sorted(os.sched_getaffinity(0)) if _SUPPORTED else []


def assign(processes: int) -> list[int | None]:
    """One core for each of ``processes`` processes, in launch order, round robin over :func:`cores`
    (None for each where affinity is not supported)."""
    available = cores()
    return [available[k % len(available)] if available else None for k in range(processes)]


def pin_loop_threads(core: int, *, every_thread: bool = False) -> None:
    """The calling thread (the event loop's) and every ZeroMQ I/O thread of this process on
    ``core``; threads the calling thread starts from now on start there too (ZeroMQ contexts made
    later included). A ZeroMQ thread is known by the name it gives itself once it runs, so one
    started a moment ago may not be found: ``every_thread`` pins every thread of the process
    instead (a dock server, which computes nothing)."""
    global _all_cores
    if not _SUPPORTED:
        return
    if _all_cores is None:
        _all_cores = os.sched_getaffinity(0)
    os.sched_setaffinity(threading.get_native_id(), {core})
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError, ValueError):  # a thread that ended meanwhile
            if every_thread or (task / "comm").read_text().startswith("ZMQbg/"):
                os.sched_setaffinity(int(task.name), {core})


def released(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` after :func:`release_this_thread`: for a thread call (``anyio.to_thread``) that
    computes, from an event loop that may be pinned."""
    release_this_thread()
    return fn(*args)


def release_this_thread() -> None:
    """The calling thread back on every core the process could use before :func:`pin_loop_threads`
    (once per thread; nothing where no loop was pinned): for compute threads, and the OpenMP
    threads they start, which would otherwise inherit the loop's core."""
    if _all_cores is None or getattr(_released, "done", False):
        return
    os.sched_setaffinity(threading.get_native_id(), _all_cores)
    _released.done = True
