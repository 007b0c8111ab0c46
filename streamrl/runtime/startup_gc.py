"""The cyclic garbage collector paused while a process starts up.

Start-up (importing torch, transformers and streamrl) makes some 300 000 to 400 000 objects that
live as long as the process, and the collector's full passes during those imports rescan every
one of them: in a W1 quickstart the launcher spent about 0.4 s and the workers' forkserver 0.5 s
of CPU in them, on a machine whose two cores the launcher, the forkserver and the dock share at
that moment (docs/benchmarks.md §39). Paused, nothing is collected until start-up is over; then
:func:`resume` freezes what start-up made (``gc.freeze``: later full passes skip it, and a process
forked afterwards never writes to those objects' pages for the collector's bookkeeping) and turns
the collector back on. Import-time objects are almost never cyclic garbage, so little is kept that
a pass would have freed.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

_paused = False  # this module turned the collector off (a user who did so themselves keeps it off)


def pause() -> None:
    """Turn the collector off for start-up, if it is on."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume() -> None:
    """Start-up is over: freeze the objects it made and turn the collector back on, if
    :func:`pause` turned it off (otherwise nothing)."""
    global _paused
    if _paused:
        gc.freeze()
        gc.enable()
        _paused = False


@contextmanager
def paused() -> Iterator[None]:
    """:func:`pause` for the block, :func:`resume` after it (also when it raises)."""
    pause()
    try:
        yield
    finally:
        resume()
