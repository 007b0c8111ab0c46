"""The workers' forkserver (``resources.launch: processes``): started first, stopped if the run's
checks fail. Its own imports are the standard library's (and runtime/orphans'), so ``streamrl run``
can start it before the launcher imports anything heavy (:mod:`streamrl.cli`)."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
from collections.abc import Mapping

# How long an idle OpenMP thread spins before it sleeps, in libgomp's spin iterations (one
# `pause` instruction each, ten to a few hundred cycles depending on the CPU). Long enough
# to bridge the gaps between a compute call's parallel regions, short enough that a stage which
# stopped computing frees its core soon. OpenMP's default (300000) burns cores another stage
# computes on: generate and train on 2 cores slowed each other 5-50x with it. Passive waits (0)
# make every region pay a wake-up: a second thread then costs more than it gives. 3000 and 1000
# cost W2's synchronous run 15-35 %. The run's core share (streamrl.engines.core_share) keeps at
# most one computing thread per core, which is what lets the threads spin at all. Measured:
# docs/benchmarks.md §19.
SPIN_COUNT = "20000"


def openmp_waits(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The OpenMP wait settings the workers start with: the user's own where they set
    OMP_WAIT_POLICY or GOMP_SPINCOUNT, else a short spin."""
    own = {name: environ[name] for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if name in environ}
    return own or {"GOMP_SPINCOUNT": SPIN_COUNT}


# Set before the forkserver imports torch (OpenMP reads it once, when it loads); workers inherit it.
os.environ.update(openmp_waits())

# Workers fork from a server that imported these once: start-up costs one torch/transformers
# import instead of one per worker. Forking happens before any OpenMP pool or CUDA context exists
# (the server only imports), which is what makes fork safe here. The stage modules import their
# engines and models where they use them (the launcher imports the stages for its checks only),
# so those are named here too.
PRELOAD = ["torch", "transformers", "streamrl.runtime.worker", "streamrl.models.build", "streamrl.engines.rollout",
           "streamrl.engines.fsdp", "streamrl.engines.checkpoint", "streamrl.reshard.fsdp_layout",
           "streamrl.stages.source", "streamrl.stages.generate", "streamrl.stages.score", "streamrl.stages.advantage",
           "streamrl.stages.reference", "streamrl.stages.train", "streamrl.stages.weight_source"]
context = multiprocessing.get_context("forkserver")  # the workers' processes (LocalProcesses)
# the server imports PRELOAD through this module, with the garbage collector paused (its docstring)
context.set_forkserver_preload(["streamrl.runtime.forkserver_preload"])

_started_helpers: list[str] = []  # what start_forkserver started: its stop_forkserver stops those only


def use_private_temp_dir() -> None:
    """multiprocessing's temporary directory in this process (where the forkserver's socket lives)
    made as a launcher's private directory, ``/tmp/srl-*`` with an owner file (runtime/orphans.py),
    in place of multiprocessing's own ``/tmp/pymp-*``. Removed at exit as multiprocessing removes
    its own; a launcher killed with SIGKILL cannot, and the next run's start-up sweep then does
    (nothing could tell whose a ``pymp-*`` directory was). Idempotent; a process that used
    multiprocessing's directory already keeps it."""
    from multiprocessing import process, util
    from pathlib import Path

    from streamrl.runtime.orphans import make_private_dir, remove_private_dir

    config = process.current_process()._config  # CPython's own record of it (multiprocessing.util.get_temp_dir)
    if config.get("tempdir") is None:
        d = make_private_dir("/tmp")
        util.Finalize(None, remove_private_dir, args=(Path(d),), exitpriority=-100)  # as get_temp_dir's own
        config["tempdir"] = d


def start_forkserver() -> None:
    """Start the workers' forkserver now (idempotent): its imports (torch, transformers, the
    built-in stages: seconds of CPU) then run while the launcher checks the run and starts the dock,
    instead of after, when the first worker is forked. The server exits with the launcher."""
    from multiprocessing import forkserver, resource_tracker

    use_private_temp_dir()
    if getattr(forkserver._forkserver, "_forkserver_pid", None) is None:
        _started_helpers.append("forkserver")
    if getattr(resource_tracker._resource_tracker, "_pid", None) is None:
        _started_helpers.append("resource tracker")  # the forkserver starts multiprocessing's tracker
    forkserver.ensure_running()


def stop_forkserver() -> None:
    """Stop a forkserver :func:`start_forkserver` started (a run that failed its checks starts no
    worker, so none is left behind): killed, as it may still be importing, then reaped, and its
    socket removed."""
    from multiprocessing import forkserver, resource_tracker

    # CPython's one ForkServer and ResourceTracker (their _stop has no public name)
    server, pid = forkserver._forkserver, getattr(forkserver._forkserver, "_forkserver_pid", None)
    if "forkserver" in _started_helpers and pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        server._stop()
    if "resource tracker" in _started_helpers:
        resource_tracker._resource_tracker._stop()
    _started_helpers.clear()
