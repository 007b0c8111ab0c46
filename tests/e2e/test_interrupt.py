"""Ctrl-C on ``streamrl run``: the launcher stops every process it started and exits 130.
SIGTERM takes the same path (the CLI re-raises it as SIGINT), also where SIGINT is ignored, as
for a command started with ``&`` from a script. SIGUSR1 before it only dumps the launcher's stacks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.runtime.hygiene import (
    descendants,
    ipc_dirs,
    leftover_ipc_dirs,
    processes_with_files_under,
    run_ipc_dirs,
    wait_gone,
)

REPO = Path(__file__).resolve().parents[2]
DIGITS = REPO / "configs" / "grpo_digits.yaml"


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # what a non-interactive shell does for `cmd &`


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("sent", "sigint_ignored"), [
    (signal.SIGINT, False),
    # the slow tier: the same stop path, entered by SIGTERM in a process that ignores SIGINT
    pytest.param(signal.SIGTERM, True, marks=pytest.mark.slow)], ids=["sigint", "sigterm-with-sigint-ignored"])
def test_an_interrupt_stops_the_run_and_every_process(tmp_path: Path, sent: signal.Signals,
                                                       sigint_ignored: bool) -> None:
    before = ipc_dirs()
    out = tmp_path / "out.txt"
    with out.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "streamrl.cli", "run", str(DIGITS), "algo.steps=100000", "algo.stop_reward=null",
             f"output.run_dir={tmp_path / 'runs'}", "output.progress=lines"],
            stdout=sink, stderr=subprocess.STDOUT, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
            preexec_fn=_ignore_sigint if sigint_ignored else None,
        )
    try:
        # wait until it trains: the first step's line is in metrics.jsonl
        deadline = time.monotonic() + 120
        metrics: Path | None = None
        while time.monotonic() < deadline and proc.poll() is None:
            found = list((tmp_path / "runs").glob("*/metrics.jsonl"))
            if found and found[0].read_text().strip():
                metrics = found[0]
                break
            time.sleep(0.2)
        assert metrics is not None, f"no step within 120 s (exit code {proc.poll()}):\n{out.read_text()}"
        run_dir = metrics.parent
        started = descendants(proc.pid)  # dock servers, the forkserver, the workers
        assert len(started) >= 5, started  # controller + warehouse + the source and train workers + the forkserver
        dirs = run_ipc_dirs(run_dir)
        assert dirs and all(d.exists() for d in dirs)

        # `kill -USR1` on the launcher writes its threads' stacks to its stderr, and the run goes on
        proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while "(most recent call first)" not in out.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "(most recent call first)" in out.read_text() and proc.poll() is None, out.read_text()

        t0 = time.monotonic()
        proc.send_signal(sent)
        code = proc.wait(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    text = out.read_text()
    assert code == 130, text
    assert took <= 20, f"exit took {took:.1f} s"
    assert "interrupted" in text and "Traceback" not in text
    assert not wait_gone(started, 10), {p: c for p, c in started.items() if os.path.exists(f"/proc/{p}")}
    assert not processes_with_files_under(run_dir)
    assert not [d for d in dirs if d.exists()]
    assert not leftover_ipc_dirs(before, run_dir)
