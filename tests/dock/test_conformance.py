"""The conformance script (raw pyzmq + msgpack, docs/dock-protocol.md only) passes against LocalDock."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from streamrl.dock.controller import ConsumerView
from streamrl.dock.launch import LocalDock
from streamrl.dock.limits import DockLimits

SCRIPT = Path(__file__).resolve().parents[2] / "ops" / "conformance" / "dock.py"


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=240)


@pytest.mark.parametrize(("warehouses", "block"), [(1, 1), (2, 1), (2, 3)])
def test_conformance_suite_passes_against_local_dock(warehouses: int, block: int) -> None:
    views = {"score": ConsumerView(["tokens", "answer"])}
    with LocalDock(["score"], capacity=32, n_warehouses=warehouses, views=views,
                   limits=DockLimits(max_clients=8), block=block) as dock:
        proc = _run(["--controller", dock.controller_endpoint, "--consumer", "score", "--reads", "tokens,answer",
                     "--allow-close", "--max-clients", "8"])
        assert dock.alive()
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "FAIL" not in out and "SKIP" not in out, out
    assert out.strip().splitlines()[-1].endswith(" passed, 0 failed"), out
    assert len([ln for ln in out.splitlines() if ln.startswith("PASS ")]) >= 17  # every check ran


def test_conformance_suite_reports_failures_with_exit_code_1() -> None:
    """Pointed at something that is not a dock (a silent ROUTER), it fails, and says so."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        proc = _run(["--controller", f"tcp://127.0.0.1:{port}", "--timeout", "0.5"])
    finally:
        sock.close(0)
    assert proc.returncode == 1
    assert "FAIL hello" in proc.stdout and proc.stdout.strip().splitlines()[-1].endswith("1 failed")
