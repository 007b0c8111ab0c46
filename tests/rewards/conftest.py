"""Real reward-server processes for the tests: started on free ports, always stopped afterwards."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
MINIMAL_SERVER = REPO / "ops" / "rewards" / "minimal_server.py"
MISBEHAVING_SERVER = HERE / "misbehaving_reward_server.py"
LOOPBACK = "tcp://127.0.0.1:0"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class ServerProcess:
    """One server process; ``endpoint`` is what it reported in its READY line."""

    def __init__(self, args: list[str], *, ready_timeout_s: float = 15.0) -> None:
        self.args = args
        # A file, not a pipe: a chatty server can never block on a full pipe. Closed in stop().
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE), os.environ.get("PYTHONPATH", "")]),
        }
        self.proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=env, cwd=HERE
        )
        self.endpoint = self._wait_ready(ready_timeout_s)

    def _wait_ready(self, timeout_s: float) -> str:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if selector.select(timeout=max(0.0, deadline - time.monotonic())):
                    line = self.proc.stdout.readline()
                    if line.startswith("READY "):
                        return line.split()[1]
                    if not line:  # exited before READY
                        break
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        stderr = self.stderr()
        self.stop()
        raise AssertionError(f"{self.args} did not print READY within {timeout_s}s; stderr:\n{stderr}")

    def stderr(self) -> str:
        self._stderr.flush()
        self._stderr.seek(0)
        return self._stderr.read()

    def signal(self, signum: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signum)

    def wait(self, timeout_s: float = 10.0) -> int:
        return self.proc.wait(timeout=timeout_s)

    def stop(self) -> None:
        """SIGKILL if still running (SIGCONT first, in case a test froze it), then reap."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=10)
        if self.proc.stdout:
            self.proc.stdout.close()
        self._stderr.close()


class Servers:
    """Factory for server processes; the fixture stops every one of them at teardown."""

    def __init__(self) -> None:
        self.started: list[ServerProcess] = []

    def reward_server(self, function: str, *args: str, bind: str = LOOPBACK) -> ServerProcess:
        """``python -m streamrl.rewards.cli reward-server FUNCTION --bind BIND ARGS``."""
        command = [
            sys.executable,
            "-m",
            "streamrl.rewards.cli",
            "reward-server",
            function,
            "--bind",
            bind,
            *args,
        ]
        return self._start(command)

    def script(self, path: Path, *args: str) -> ServerProcess:
        return self._start([sys.executable, str(path), *args])

    def _start(self, command: list[str]) -> ServerProcess:
        server = ServerProcess(command)
        self.started.append(server)
        return server

    def stop_all(self) -> None:
        for server in self.started:
            server.stop()


@pytest.fixture
def servers() -> Iterator[Servers]:
    factory = Servers()
    try:
        yield factory
    finally:
        factory.stop_all()
