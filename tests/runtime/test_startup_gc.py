"""The garbage collector paused through start-up (streamrl.runtime.startup_gc): off while a
process imports, back on with start-up's objects frozen after; the workers' forkserver imports
its preload that way, so every worker forks with the collector on and those objects frozen."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120  # the forkserver imports torch and transformers (slow on busy cores)


def _python(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=TIMEOUT_S, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_pause_turns_the_collector_off_and_resume_back_on_with_start_ups_objects_frozen() -> None:
    out = _python("""
        import gc
        from streamrl.runtime import startup_gc
        startup_gc.pause()
        print(gc.isenabled(), gc.get_freeze_count())
        import json, decimal  # start-up's imports
        startup_gc.resume()
        print(gc.isenabled(), gc.get_freeze_count() > 1000)
        startup_gc.resume()  # a second resume changes nothing
        print(gc.isenabled())
    """)
    assert out.splitlines() == ["False 0", "True True", "True"]


def test_a_collector_the_user_turned_off_stays_off() -> None:
    out = _python("""
        import gc
        from streamrl.runtime import startup_gc
        gc.disable()
        with startup_gc.paused():
            pass
        print(gc.isenabled(), gc.get_freeze_count())
    """)
    assert out == "False 0"


def report_collector(conn: Any) -> None:
    """In a forked worker: is the collector on, how many objects are frozen, is torch imported."""
    conn.send((gc.isenabled(), gc.get_freeze_count(), "torch" in sys.modules))
    conn.close()


def test_workers_fork_with_the_collector_on_and_the_preloaded_modules_frozen() -> None:
    """A process forked from the run's forkserver (as every worker is): the collector is on, and the
    forkserver's imports (torch among them: far more than 100 000 objects) are frozen."""
    out = _python("""
        from streamrl.runtime.forkserver import context, start_forkserver, stop_forkserver
        from tests.runtime.test_startup_gc import report_collector
        start_forkserver()
        try:
            ours, theirs = context.Pipe()
            proc = context.Process(target=report_collector, args=(theirs,))
            proc.start()
            theirs.close()
            if not ours.poll(60):
                raise SystemExit("the forked process did not report")
            enabled, frozen, torch = ours.recv()
            proc.join(30)
            print(enabled, frozen > 100_000, torch, proc.exitcode)
        finally:
            stop_forkserver()
    """)
    assert out == "True True True 0"
