"""Spawning and reaping the dock test worker processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

WORKER = str(Path(__file__).with_name("dock_worker.py"))


def spawn_worker(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, WORKER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def stop_all(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        for s in (proc.stdout, proc.stderr):
            if s:
                s.close()
