"""A real digits run whose dock links are reset mid-run completes (issue 25).

``streamrl run`` with the dock over tcp; twice during training every established TCP connection
of the dock controller (the warehouse's link and every worker's) is destroyed with ``ss -K``
(the kernel aborts the socket and sends the peer a reset). ZeroMQ reconnects; the warehouse
registers again and resends its unanswered readiness messages, the workers resend their requests
in flight (docs/dock-protocol.md §5.8). The run must finish every step, exit 0, and every step's
metrics row be there. Skipped where ``ss -K`` cannot destroy sockets (no CAP_NET_ADMIN, or a
kernel without INET_DIAG_DESTROY).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.runtime.hygiene import descendants

REPO = Path(__file__).resolve().parents[2]
DIGITS = REPO / "configs" / "grpo_digits.yaml"
STEPS = 16


def _ss_kill_works() -> bool:
    """``ss -K`` resets a loopback connection here (it is a privileged, kernel-dependent tool)."""
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):
            s, _ = srv.accept()
            with s:
                subprocess.run(["ss", "-K", "dst", "127.0.0.1", "dport", "=", str(port)], capture_output=True,
                               timeout=10, check=False)
                s.settimeout(1.0)
                try:
                    return s.recv(1) == b""  # closed by the kill (a reset raises, below)
                except ConnectionResetError:
                    return True
                except OSError:
                    return False


def _listening_port(pid: int) -> int | None:
    out = subprocess.run(["ss", "-tlnpH"], capture_output=True, text=True, timeout=10, check=False).stdout
    for line in out.splitlines():
        if f"pid={pid}," in line:
            m = re.search(r"127\.0\.0\.1:(\d+)", line)
            if m:
                return int(m.group(1))
    return None


def _controller_pid(root: int) -> int | None:
    for pid in descendants(root):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"streamrl.dock.controller" in cmd:
            return pid
    return None


def _steps_done(run_root: Path) -> int:
    found = list(run_root.glob("*/metrics.jsonl"))
    return len(found[0].read_text().splitlines()) if found else 0


@pytest.mark.timeout(300)
@pytest.mark.slow  # the slow tier; the default one resets links under a dock stream (tests/dock/test_reconnect.py)
@pytest.mark.skipif(not sys.platform.startswith("linux") or not _ss_kill_works(),
                    reason="needs `ss -K` (CAP_NET_ADMIN, INET_DIAG_DESTROY) to reset a live TCP connection")
def test_a_digits_run_whose_dock_links_are_reset_mid_run_completes(tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    runs = tmp_path / "runs"
    with out.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "streamrl.cli", "run", str(DIGITS), f"algo.steps={STEPS}", "algo.stop_reward=null",
             "resources.dock.transport=tcp", f"output.run_dir={runs}", "output.progress=none"],
            stdout=sink, stderr=subprocess.STDOUT, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    try:
        killed = 0
        for at_step in (3, 8):
            deadline = time.monotonic() + 150
            while _steps_done(runs) < at_step and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert proc.poll() is None and _steps_done(runs) >= at_step, out.read_text()[-4000:]
            ctl = _controller_pid(proc.pid)
            port = _listening_port(ctl) if ctl else None
            assert port is not None, f"dock controller not found listening (pid {ctl})"
            kill = subprocess.run(["ss", "-K", "-tn", "state", "established", "sport", "=", f":{port}"],
                                  capture_output=True, text=True, timeout=10, check=False)
            killed += sum(1 for line in kill.stdout.splitlines() if f":{port}" in line)
        assert killed >= 2 * 2, kill.stdout  # each time at least the warehouse's link and a worker's
        assert proc.wait(timeout=150) == 0, out.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert _steps_done(runs) == STEPS
