"""ops/conformance/reward_server.py against both of our implementations, and against broken ones.

Each run is the script as a subprocess (how an outside implementer uses it) pointed at a real server
process on 127.0.0.1 with a port the OS picked.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.rewards.conftest import LOOPBACK, MINIMAL_SERVER, MISBEHAVING_SERVER, REPO, Servers

pytestmark = pytest.mark.timeout(180)

SUITE = REPO / "ops" / "conformance" / "reward_server.py"
EXACT_MATCH = "streamrl.rewards.builtin:exact_match"


def run_suite(endpoint: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SUITE), endpoint, "--timeout-s", "5", *args],
        capture_output=True,
        text=True,
        timeout=150,
    )


def assert_all_passed(done: subprocess.CompletedProcess[str]) -> None:
    lines = done.stdout.splitlines()
    failures = [line for line in lines if line.startswith("FAIL")]
    assert done.returncode == 0 and not failures, "\n".join(failures) or done.stderr
    checks = [line for line in lines[:-1] if line.startswith("PASS ")]
    assert len(checks) >= 25 and lines[-1] == f"{len(checks)} passed, 0 failed"


def test_streamrl_reward_server_conforms(servers: Servers) -> None:
    server = servers.reward_server(EXACT_MATCH)
    assert_all_passed(run_suite(server.endpoint))
    assert server.proc.poll() is None


def test_minimal_outsider_server_conforms(servers: Servers) -> None:
    server = servers.script(MINIMAL_SERVER, "--bind", LOOPBACK)
    assert_all_passed(run_suite(server.endpoint))
    assert server.proc.poll() is None


def test_structure_mode_accepts_any_reward_function(servers: Servers) -> None:
    server = servers.reward_server("tests.rewards.reward_test_functions:named")
    assert_all_passed(run_suite(server.endpoint, "--scores", "structure"))


def test_curve(servers: Servers, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    made = subprocess.run(
        [sys.executable, "-m", "streamrl.rewards.cli", "keys", "generate", str(keys)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert made.returncode == 0, made.stderr
    server = servers.reward_server(
        EXACT_MATCH,
        "--curve-secret-key",
        str(keys / "server.key_secret"),
        "--curve-allow",
        str(keys / "client.key"),
    )
    assert_all_passed(
        run_suite(
            server.endpoint,
            "--curve-server-key",
            str(keys / "server.key"),
            "--curve-client-key",
            str(keys / "client.key_secret"),
        )
    )


@pytest.mark.parametrize(
    ("mode", "failing_check"),
    [
        (
            "wrong_count",
            "FAIL score: one result per sample, in request order, ids echoed: score: 3 results for 4",
        ),
        ("nil_fields", "FAIL bad_request: "),  # answers without validating anything
    ],
)
def test_a_non_conforming_server_fails_with_the_check_named(
    servers: Servers, mode: str, failing_check: str
) -> None:
    server = servers.script(MISBEHAVING_SERVER, mode, "--bind", LOOPBACK)
    # The server does not answer what it cannot decode, so each such check waits out the timeout:
    # 0.5 s keeps that short, and a live server answers in milliseconds.
    done = run_suite(server.endpoint, "--scores", "structure", "--timeout-s", "0.5")
    assert done.returncode == 1
    assert any(line.startswith(failing_check) for line in done.stdout.splitlines()), done.stdout
    passed, failed = done.stdout.splitlines()[-1].split(" passed, ")
    assert int(passed) > 0 and failed.endswith(" failed") and int(failed.split()[0]) > 0


def test_no_server_fails_fast_and_says_so() -> None:
    done = run_suite("tcp://127.0.0.1:9", "--timeout-s", "0.5")  # port 9 (discard): nothing listens
    assert done.returncode == 1
    assert "the server did not answer hello" in done.stdout
    assert done.stdout.splitlines()[-1].startswith("0 passed, ")


def test_bad_arguments_exit_2(tmp_path: Path) -> None:
    done = run_suite("tcp://127.0.0.1:9", "--curve-server-key", str(tmp_path / "missing.key"))
    assert done.returncode == 2 and "missing.key" in done.stderr
