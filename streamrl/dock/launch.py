"""Start and stop a dock (one controller + W warehouses) as local processes.

Each server is ``python -m streamrl.dock.{controller,warehouse}`` in its own process group,
announcing the endpoint it bound with a ``READY <endpoint>`` line (so ``tcp://127.0.0.1:0``
gets its port from the OS; a warehouse prints it only once the controller accepted it).
``stop()`` sends SIGTERM, waits, then SIGKILLs stragglers, and removes the private ipc
directory: nothing outlives the :class:`LocalDock`.

Each dock gets a fresh secret (:func:`streamrl.dock.limits.new_secret`), handed to the
controller and its warehouses in the environment (not argv, which any local user can read):
only warehouses that know it can register, so no other peer can pose as one.

A launched run gives its dock the run's credentials (``auth``,
:class:`streamrl.security.RunCredentials`): the servers get what verifies every role, and the
warehouses role ``dock``'s own credentials for their link to the controller, in the environment
too (``STREAMRL_SERVER_AUTH``, ``STREAMRL_CLIENT_AUTH``); every server socket then admits only
the run's roles, so each client needs its role's credentials (``DockClient(auth=...)``). A dock
bound beyond loopback (``host`` a routable address) must use CURVE.
"""

from __future__ import annotations

import ipaddress
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Literal

import msgspec
import zmq

from streamrl.dock.authz import DockPolicy
from streamrl.dock.controller import ControllerServer
from streamrl.dock.limits import SECRET_ENV, DockLimits, new_secret
from streamrl.dock.state import ConsumerView
from streamrl.security import (
    CLIENT_ENV,
    DOCK,
    SERVER_ENV,
    ClientAuth,
    RunCredentials,
    ServerAuth,
    release_context,
)

if TYPE_CHECKING:
    from streamrl.dock.warehouse import WarehouseServer

Transport = Literal["tcp", "ipc"]


class DockStartError(RuntimeError):
    """A dock server did not come up; the message carries its stderr."""


def _read_ready(proc: subprocess.Popen[str], name: str, timeout_s: float) -> str:
    """Wait for the ``READY <endpoint>`` line of a server process."""
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                break
            line = proc.stdout.readline()
            if not line:  # EOF: the process died
                break
            if line.startswith("READY "):
                return line.split(None, 1)[1].strip()
    finally:
        sel.close()
    err = ""
    log = getattr(proc, "log_file", None)
    if log is not None:
        log.seek(0)
        err = log.read()[-2000:]
    raise DockStartError(f"{name} did not report READY within {timeout_s} s (exit code {proc.poll()}): {err}")


@dataclass
class LocalDock:
    """A dock running as local processes. Use as a context manager or call start()/stop()."""

    consumers: list[str]
    capacity: int
    n_warehouses: int = 1
    transport: Transport = "tcp"
    start_timeout_s: float = 60.0
    log_level: str = "WARNING"
    limits: DockLimits = field(default_factory=DockLimits)
    # each consumer's reads/whole_groups, fixed at start (the launcher passes the pipeline's);
    # None: each consumer's first claim fixes its view (tests, benchmarks)
    views: dict[str, ConsumerView] | None = None
    # the run's credentials (a launched run always passes them; None: no authentication, for tests
    # and benchmarks of the bare protocol); CURVE ones are required when ``host`` is not loopback
    auth: RunCredentials | None = None
    host: str = "127.0.0.1"  # tcp binds: tcp://{host}:0 (a node's routable address for a multi-node run)
    block: int = 1  # samples per ownership block: sample k lives on warehouse (k // block) % n_warehouses
    # the core of each server's event loop and ZeroMQ I/O threads, the controller's first, then each
    # warehouse's (streamrl.loop_affinity); None: the kernel places them
    loop_cores: list[int | None] | None = None
    # the pipeline's declarations (column owners, consumers, producers) the servers enforce per role;
    # None: no authorization (tests, benchmarks)
    policy: DockPolicy | None = None
    controller_endpoint: str = ""
    warehouse_endpoints: list[str] = field(default_factory=list)
    _procs: list[subprocess.Popen[str]] = field(default_factory=list)
    _ipc_dir: str | None = None
    _secret: str = field(default_factory=new_secret, repr=False)

    def _bind(self, name: str) -> str:
        if self.transport == "tcp":
            return f"tcp://{self.host}:0"
        assert self._ipc_dir is not None
        return f"ipc://{self._ipc_dir}/{name}"

    def _spawn(self, args: list[str]) -> subprocess.Popen[str]:
        env = {**os.environ, "STREAMRL_LOG": self.log_level, "PYTHONUNBUFFERED": "1", SECRET_ENV: self._secret}
        env.pop(SERVER_ENV, None)  # only this dock's own credentials, never ones this process inherited
        env.pop(CLIENT_ENV, None)
        if self.auth is not None:  # the environment, never argv
            env[SERVER_ENV] = self.auth.server().to_env()
            env[CLIENT_ENV] = self.auth.client(DOCK).to_env()
        # stderr to a temp file, not a pipe: a chatty server must never block on a full pipe
        log = tempfile.TemporaryFile(mode="w+", prefix="streamrl-dock-")  # noqa: SIM115 - closed in stop()
        # own session: a Ctrl-C at the terminal reaches the launcher, which then stops us in order
        proc = subprocess.Popen(
            [sys.executable, "-m", *args], stdout=subprocess.PIPE, stderr=log, text=True,
            env=env, start_new_session=True,
        )
        proc.log_file = log  # type: ignore[attr-defined]
        self._procs.append(proc)
        return proc

    def _loop_core(self, server: int) -> list[str]:
        core = self.loop_cores[server] if self.loop_cores is not None and server < len(self.loop_cores) else None
        return [] if core is None else ["--loop-core", str(core)]

    def start(self) -> LocalDock:
        if self.transport not in ("tcp", "ipc"):
            raise ValueError(f"dock transport must be 'tcp' or 'ipc', got {self.transport!r}")
        if (self.transport == "tcp" and not is_loopback(self.host)
                and (self.auth is None or self.auth.mechanism != "curve")):
            raise ValueError(f"a dock bound beyond loopback (host {self.host!r}) needs the run's CURVE credentials: "
                             "LocalDock(auth=RunCredentials.generate('curve', roles), ...), and each DockClient "
                             "its role's (auth=credentials.client(role))")
        if self.transport == "ipc":
            # short path: ipc socket paths are limited to ~100 bytes
            self._ipc_dir = tempfile.mkdtemp(prefix="srl-", dir="/tmp")
        try:
            # the controller's --views reads this back with the same type (controller.parse_views)
            views = ["--views", msgspec.json.encode(self.views).decode()] if self.views else []
            policy = ["--policy", msgspec.json.encode(self.policy).decode()] if self.policy else []
            ctl = self._spawn([
                "streamrl.dock.controller", "--bind", self._bind("controller"),
                "--consumers", ",".join(self.consumers), "--capacity", str(self.capacity),
                "--warehouses", str(self.n_warehouses), "--parent-pid", str(os.getpid()),
                "--block", str(self.block), *self.limits.argv(), *views, *policy, *self._loop_core(0),
            ])
            self.controller_endpoint = _read_ready(ctl, "dock controller", self.start_timeout_s)
            whs = [
                self._spawn([
                    "streamrl.dock.warehouse", "--bind", self._bind(f"warehouse-{w}"),
                    "--controller", self.controller_endpoint, "--id", str(w),
                    "--warehouses", str(self.n_warehouses), "--parent-pid", str(os.getpid()),
                    "--register-timeout", str(self.start_timeout_s), "--block", str(self.block),
                    *self.limits.argv(), *policy, *self._loop_core(1 + w),
                ])
                for w in range(self.n_warehouses)
            ]
            self.warehouse_endpoints = [
                _read_ready(proc, f"dock warehouse {w}", self.start_timeout_s) for w, proc in enumerate(whs)
            ]
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def alive(self) -> bool:
        return bool(self._procs) and all(p.poll() is None for p in self._procs)

    def stop(self, timeout_s: float = 10.0) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
            for stream in (proc.stdout, getattr(proc, "log_file", None)):
                _close(stream)
        self._procs.clear()
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None

    def ipc_files(self) -> list[Path]:
        return list(Path(self._ipc_dir).iterdir()) if self._ipc_dir else []

    def __enter__(self) -> LocalDock:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a socket on this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name or an interface: treat as reachable from outside


def _close(stream: IO[str] | None) -> None:
    if stream is not None:
        try:
            stream.close()
        except OSError:
            pass


@dataclass
class ThreadDock:
    """The same servers in threads of this process (``resources.launch: inprocess``, debugging)."""

    consumers: list[str]
    capacity: int
    n_warehouses: int = 1
    limits: DockLimits = field(default_factory=DockLimits)
    views: dict[str, ConsumerView] | None = None
    start_timeout_s: float = 60.0
    # the run's credentials (see LocalDock). A ThreadDock given them runs its servers on a zmq
    # context of its own (a context's ZAP handler serves one run), stopped with the dock
    auth: RunCredentials | None = None
    block: int = 1
    policy: DockPolicy | None = None  # see LocalDock
    controller_endpoint: str = ""
    warehouse_endpoints: list[str] = field(default_factory=list)
    _servers: list[object] = field(default_factory=list)
    _threads: list[threading.Thread] = field(default_factory=list)
    _context: zmq.Context | None = None

    def start(self) -> ThreadDock:
        from streamrl.dock.warehouse import WarehouseServer  # torch: only when a ThreadDock starts

        secret = new_secret()
        server_auth: ServerAuth | None = None
        dock_auth: ClientAuth | None = None
        if self.auth is not None:
            self._context = zmq.Context()
            server_auth, dock_auth = self.auth.server(), self.auth.client(DOCK)
        ctl = ControllerServer("tcp://127.0.0.1:0", self.consumers, self.capacity, self.n_warehouses,
                               secret=secret, limits=self.limits, views=self.views, auth=server_auth,
                               block=self.block, context=self._context, policy=self.policy)
        self.controller_endpoint = ctl.endpoint
        self._run(ctl)  # serving before the warehouses register: they wait for its answer
        try:
            for w in range(self.n_warehouses):
                wh = WarehouseServer("tcp://127.0.0.1:0", ctl.endpoint, w, self.n_warehouses, secret=secret,
                                     limits=self.limits, auth=server_auth, dock_auth=dock_auth,
                                     block=self.block, context=self._context, policy=self.policy)
                try:
                    wh.register(self.start_timeout_s)
                except BaseException:
                    wh.close()
                    raise
                self.warehouse_endpoints.append(wh.endpoint)
                self._run(wh)
        except BaseException:
            self.stop()
            raise
        return self

    def _run(self, server: ControllerServer | WarehouseServer) -> None:
        t = threading.Thread(target=server.serve_forever, name=f"dock-{type(server).__name__}", daemon=True)
        t.start()
        self._servers.append(server)
        self._threads.append(t)

    def stop(self, timeout_s: float = 10.0) -> None:
        for s in self._servers:
            s.stop()  # type: ignore[attr-defined]
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(timeout=max(0.1, deadline - time.monotonic()))
        joined = not any(t.is_alive() for t in self._threads)
        self._servers.clear()
        self._threads.clear()
        if self._context is not None:
            ctx, self._context = self._context, None
            release_context(ctx)  # stop its ZAP handler thread
            if joined:  # every server closed its sockets: term() returns at once
                ctx.term()

    def __enter__(self) -> ThreadDock:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
