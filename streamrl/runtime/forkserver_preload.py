"""What the workers' forkserver imports before it forks any worker (its one preload module):
:data:`streamrl.runtime.forkserver.PRELOAD`, with the garbage collector paused, and the objects
they made frozen (:mod:`streamrl.runtime.startup_gc`). Every worker then forks with the
collector on and those objects outside its passes."""

from __future__ import annotations

import contextlib
import importlib

from streamrl.runtime.forkserver import PRELOAD
from streamrl.runtime.startup_gc import paused

with paused():
    for _name in PRELOAD:
        with contextlib.suppress(ImportError):  # as the forkserver's own preload loop: skipped, not fatal
            importlib.import_module(_name)
