"""The conformance script (raw pyzmq + msgpack, docs/dock-protocol.md only) passes against LocalDock."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from streamrl.dock.authz import DockPolicy
from streamrl.dock.controller import ConsumerView
from streamrl.dock.launch import LocalDock
from streamrl.dock.limits import DockLimits

SCRIPT = Path(__file__).resolve().parents[2] / "ops" / "conformance" / "dock.py"


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=240)


@pytest.mark.parametrize(("warehouses", "block", "declared"), [
    pytest.param(1, 1, False, marks=pytest.mark.slow),  # the slow tier: [2-1-False] is the same suite on more warehouses
    (2, 1, False), (2, 3, True)])
def test_conformance_suite_passes_against_local_dock(warehouses: int, block: int, declared: bool) -> None:
    views = {"score": ConsumerView(["tokens", "answer"])}
    # declared: the pipeline's column names handed to the servers (no ZAP here, so no roles: §6.2)
    policy = DockPolicy(columns={"tokens": "src", "answer": "src"}, stage_reads={"src": [], "score": ["tokens", "answer"]},
                        producers=["src"], clients={"stage:src": 5, "stage:score": 5, "launcher": 8})
    with LocalDock(["score"], capacity=32, n_warehouses=warehouses, views=views,
                   limits=DockLimits(max_clients=8), block=block, policy=policy if declared else None) as dock:
        proc = _run(["--controller", dock.controller_endpoint, "--consumer", "score", "--reads", "tokens,answer",
                     "--allow-close", "--max-clients", "8", *(["--declared-columns"] if declared else [])])
        assert dock.alive()
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    skipped = [ln for ln in out.splitlines() if ln.startswith("SKIP ")]
    # skipped only: the declared-columns check on a dock without them, and the three checks that need
    # a column of their own on a dock with them (they run on the docks without)
    assert "FAIL" not in out and skipped == [ln for ln in skipped if "declared columns" in ln], out
    assert len(skipped) == (3 if declared else 1), out
    assert out.strip().splitlines()[-1].endswith(" passed, 0 failed"), out
    assert len([ln for ln in out.splitlines() if ln.startswith("PASS ")]) + len(skipped) >= 21  # every check ran


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
