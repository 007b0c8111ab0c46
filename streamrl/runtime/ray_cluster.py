"""``resources.launch: ray``: the run's processes placed on a Ray cluster.

Ray does placement and lifecycle; the data keeps moving over ZeroMQ. The launcher (the Ray
driver) reserves one placement-group bundle per worker process (its CPUs = the stage's
``threads``, one GPU for ``device: cuda``, one NPU for ``npu``, plus
``resources.ray.stage_resources``; a colocated group shares its host stage's bundle) and
creates a :class:`ProcessHost` actor in each. The actor starts the worker as a child process
— the same ``python -m streamrl.runtime.worker SPEC`` a local run forks, with the accelerator
Ray assigned to the bundle visible — and reports its exit code. Each node that runs workers
also gets a host actor (no CPUs) for its dock warehouse; the controller's host sits on the
driver's node. Every endpoint is bound on the node's address with a port from the OS and
reaches the workers in their spec: nothing is configured by hand.

Lifecycle: every child watches its host actor (``parent_pid``) and exits when it is gone;
:meth:`RayPlacement.close` stops the children (SIGTERM, then SIGKILL), kills the actors,
removes the placement group and, for a Ray it started, shuts Ray down. A host actor that dies
(its node died, or someone killed it) turns into :attr:`RemoteProcess.lost`, which the launcher
reports naming the node.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from streamrl.config import ConfigError, RayConfig
from streamrl.runtime.pipeline import PipelineSpec, StageSpec

log = logging.getLogger("streamrl.ray")

POLL_S = 0.5  # how often the launcher asks every host for its children's exit codes
_abandoned_joins: list[threading.Thread] = []  # ray.init calls given up on (RayPlacement._join)


def join_abandoned() -> bool:
    """A ray.init given up on still runs in its daemon thread. The interpreter's teardown then
    races Ray's native threads (seen: a hang, or std::bad_alloc and an abort), so a command that
    ends now should leave with ``os._exit`` once its own cleanup is done (``streamrl.cli`` does)."""
    return any(t.is_alive() for t in _abandoned_joins)
RPC_TIMEOUT_S = 30.0  # one call to a host actor (they answer in milliseconds unless gone)


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ConfigError("resources.launch: ray needs Ray: pip install 'streamrl[ray]' "
                          "(install torch==2.13.0 first, as for streamrl itself)") from exc
    return ray


class ProcessHost:
    """A Ray actor that starts and watches child processes on its node (one worker process, or
    a node's dock servers). Its methods return at once; the children outlive no host."""

    def __init__(self) -> None:
        self.children: dict[str, subprocess.Popen[str]] = {}
        self.dirs: set[str] = set()

    def info(self) -> dict[str, Any]:
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "pid": os.getpid(), "host": os.uname().nodename}

    def make_dirs(self, paths: list[str], private: list[str]) -> None:
        """The run's directories on this node (its scratch ones are removed in :meth:`stop`)."""
        for p in paths:
            Path(p).mkdir(parents=True, exist_ok=True)
        for p in private:
            Path(p).mkdir(mode=0o700, parents=True, exist_ok=True)
            self.dirs.add(p)

    def write_private(self, path: str, data: bytes) -> None:
        """A file only its owner can read (a worker's spec: it holds the run's token and keys)."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)

    def spawn(self, key: str, argv: list[str], env: dict[str, str], log_path: str,
              ready_timeout_s: float = 0.0) -> tuple[int, str]:
        """Start ``argv`` (appending stdout and stderr to ``log_path``) in its own session; with
        ``ready_timeout_s``, wait for the ``READY <endpoint>`` line a dock server prints and
        return that endpoint too."""
        old = self.children.get(key)
        if old is not None and old.poll() is None:
            raise RuntimeError(f"{key} is still running (pid {old.pid})")
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        log_file = open(log_path, "ab")  # noqa: SIM115 - the child holds it; closed below
        try:
            proc = subprocess.Popen(
                [sys.executable, *argv], env={**os.environ, **env}, start_new_session=True, text=True,
                stdout=subprocess.PIPE if ready_timeout_s else log_file, stderr=log_file,
            )
        finally:
            log_file.close()
        self.children[key] = proc
        endpoint = ""
        if ready_timeout_s:
            from streamrl.dock.launch import _read_ready

            with open(log_path) as proc.log_file:  # type: ignore[attr-defined]  # what a failed start said
                endpoint = _read_ready(proc, key, ready_timeout_s)
        return proc.pid, endpoint

    def poll(self) -> dict[str, int | None]:
        return {key: proc.poll() for key, proc in self.children.items()}

    def signal(self, key: str, sig: int) -> None:
        proc = self.children.get(key)
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, sig)

    def free_port(self) -> int:
        """A port the OS has free on this node now (for a server one of this node's children
        binds next, e.g. the trainer's policy channel)."""
        import ray

        return free_port(ray.util.get_node_ip_address())

    def stop(self, grace_s: float = 10.0) -> dict[str, int | None]:
        """SIGTERM every child, SIGKILL what is left after ``grace_s``; remove the scratch dirs."""
        for proc in self.children.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.children.values():
            try:
                proc.wait(timeout=max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)
        return self.poll()


def join_failed(address: str, why: str) -> str:
    """What to say when the cluster at ``address`` could not be joined, with the usual fixes."""
    return (f"could not join the Ray cluster at resources.ray.address={address!r} ({why}). Is the cluster "
            "running at that address (`ray status --address ADDRESS`)? On a one-host cluster whose head was "
            "started with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (every Ray listener on 127.0.0.1), export the same "
            "variable for `streamrl run` too: without it the driver dials the host's own address instead of "
            "127.0.0.1 (docs/ray.md)")


def free_port(ip: str) -> int:
    """A port the OS has free on ``ip`` now."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as s:
        s.bind((ip, 0))
        return int(s.getsockname()[1])


@dataclass
class Node:
    """A Ray node the run uses: its id, address, and the warehouse that lives there (if any)."""

    node_id: str
    ip: str
    host: str
    warehouse: int | None = None

    def describe(self) -> str:
        return f"node {self.node_id[:12]} ({self.host}, {self.ip})"


class RemoteProcess:
    """A worker process on a Ray node, with the ``multiprocessing.Process`` surface the launcher
    uses (``pid``, ``exitcode``, ``is_alive``, ``join``, ``close``) plus ``send_signal``."""

    def __init__(self, placement: RayPlacement, host: Any, key: str, node: Node, pid: int) -> None:
        self.placement = placement
        self.host = host
        self.key = key
        self.node = node
        self.pid = pid
        self.exitcode: int | None = None
        self.lost: str | None = None  # the host actor (or its node) died: what Ray said

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.05)

    def send_signal(self, sig: int) -> None:
        if self.exitcode is None and self.lost is None:
            with contextlib.suppress(Exception):
                self.placement.ray.get(self.host.signal.remote(self.key, int(sig)), timeout=RPC_TIMEOUT_S)

    def close(self) -> None:
        pass


def process_names(pipeline: PipelineSpec) -> list[str]:
    """The name of each of ``pipeline.process_groups()``, as the launcher names the process (its
    logs, its spec): its workers in the pipeline's stage order, e.g. ``generate-0+train-0``."""
    order = {s.name: i for i, s in enumerate(pipeline.stages)}
    return ["+".join(f"{s.name}-{k}" for s, k in sorted(g, key=lambda sk: order[sk[0].name]))
            for g in pipeline.process_groups()]


def bundle_for(stages: list[StageSpec], device: str, cfg: RayConfig) -> dict[str, float]:
    """The Ray resources of one worker process running ``stages`` (a host stage and the stages
    colocated with it)."""
    bundle: dict[str, float] = {"CPU": float(max(max(s.threads for s in stages), 1))}
    kinds = {(s.device or device).split(":")[0] for s in stages}
    if "cuda" in kinds:
        bundle["GPU"] = 1.0
    if "npu" in kinds:
        bundle["NPU"] = 1.0
    for s in stages:
        for name, amount in cfg.stage_resources.get(s.name, {}).items():
            bundle[name] = max(bundle.get(name, 0.0), float(amount))
    return {k: v for k, v in bundle.items() if v > 0}


@dataclass
class RayPlacement:
    """The run's Ray side: connection, placement group, host actors, the nodes they landed on."""

    cfg: RayConfig
    run_name: str
    start_timeout_s: float
    ray: Any = None
    started_ray: bool = False
    pg: Any = None
    driver_node: Node | None = None
    nodes: dict[str, Node] = field(default_factory=dict)  # node id -> node, in warehouse order
    worker_hosts: dict[str, tuple[Any, Node]] = field(default_factory=dict)  # process name -> host, node
    dock_hosts: dict[str, Any] = field(default_factory=dict)  # node id -> its dock host
    host_pids: dict[str, int] = field(default_factory=dict)  # process name -> its host actor's pid
    processes: list[RemoteProcess] = field(default_factory=list)
    _monitor: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    def connect(self) -> None:
        """Join the cluster at ``resources.ray.address`` (within ``connect_timeout_s``), or start a
        Ray for the run. :meth:`close` from another thread ends the wait for a join at once."""
        ray = self.ray = import_ray()
        kwargs: dict[str, Any] = {"log_to_driver": False, "namespace": f"streamrl-{self.run_name}",
                                  "configure_logging": False}
        if ray.is_initialized():
            return  # the caller connected this process already (a notebook, a test)
        if self.cfg.address is None:
            kwargs.update(num_cpus=self.cfg.num_cpus, include_dashboard=False)
            self.started_ray = True
            ray.init(**kwargs)
            return
        kwargs["address"] = self.cfg.address
        self._join(kwargs)

    def _join(self, kwargs: dict[str, Any]) -> None:
        """``ray.init(address=...)`` in a daemon thread, waited for at most ``connect_timeout_s``.

        Why a thread: ray.init retries a GCS it cannot reach without end (13 minutes seen) and
        cannot be interrupted; waited for here, it held the launcher, and the process stayed alive
        after SIGTERM. A join that does not finish is left behind in its daemon thread, which does
        not keep the process alive."""
        done = threading.Event()
        failed: list[BaseException] = []

        def join() -> None:
            try:
                self.ray.init(**kwargs)
            except BaseException as exc:  # handed to the waiting thread
                failed.append(exc)
            finally:
                done.set()

        timeout_s = self.cfg.connect_timeout_s
        thread = threading.Thread(target=join, name="streamrl-ray-join", daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout_s
        while not done.wait(min(0.1, max(0.0, deadline - time.monotonic()))):
            if self._stop.is_set() or time.monotonic() >= deadline:
                _abandoned_joins.append(thread)
            if self._stop.is_set():  # the launcher is stopping (a signal): stop waiting
                raise RuntimeError(f"stopped while joining the Ray cluster at {kwargs['address']}")
            if time.monotonic() >= deadline:
                raise ConfigError(join_failed(kwargs["address"], f"not joined within resources.ray.connect_timeout_s="
                                                                 f"{timeout_s:g} s"))
        if failed:
            exc = failed[0]
            raise ConfigError(join_failed(kwargs["address"], f"{type(exc).__name__}: {exc}")) from exc

    def place(self, pipeline: PipelineSpec, device: str) -> None:
        """One bundle per worker process, the host actors in them, and the nodes they are on."""
        ray = self.ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        groups = pipeline.process_groups()
        names = process_names(pipeline)
        bundles = [bundle_for([s for s, _ in g], device, self.cfg) for g in groups]
        self.pg = placement_group(bundles, strategy=self.cfg.strategy, name=f"streamrl-{self.run_name}")
        try:
            ray.get(self.pg.ready(), timeout=self.start_timeout_s)
        except Exception as exc:
            total = ray.cluster_resources()
            raise ConfigError(
                f"Ray could not place the run's {len(bundles)} worker processes within resources.start_timeout_s="
                f"{self.start_timeout_s:g} s (strategy {self.cfg.strategy}); they need {_sum(bundles)}, the "
                f"cluster has {dict(sorted(total.items()))}. Add nodes, lower the stages' threads/workers, or fix "
                f"resources.ray.stage_resources ({type(exc).__name__})") from None
        actor = ray.remote(ProcessHost)
        for i, (name, bundle) in enumerate(zip(names, bundles, strict=True)):
            host = actor.options(
                num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
                resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
                name=f"streamrl-{self.run_name}-{name}", max_restarts=0,
            ).remote()
            self.worker_hosts[name] = (host, None)  # type: ignore[assignment]
        infos = ray.get([h.info.remote() for h, _ in self.worker_hosts.values()], timeout=self.start_timeout_s)
        for (name, (host, _)), info in zip(list(self.worker_hosts.items()), infos, strict=True):
            node = self.nodes.setdefault(info["node_id"], Node(info["node_id"], info["ip"], info["host"]))
            self.worker_hosts[name] = (host, node)
            self.host_pids[name] = int(info["pid"])
        driver_id = ray.get_runtime_context().get_node_id()
        self.driver_node = self.nodes.get(driver_id) or Node(driver_id, ray.util.get_node_ip_address(),
                                                             os.uname().nodename)

    def dock_host(self, node: Node) -> Any:
        """The (CPU-less) actor that runs the dock servers of ``node``."""
        if node.node_id not in self.dock_hosts:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            self.dock_hosts[node.node_id] = self.ray.remote(ProcessHost).options(
                num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
                name=f"streamrl-{self.run_name}-dock-{node.node_id[:12]}", max_restarts=0,
            ).remote()
        return self.dock_hosts[node.node_id]

    def all_hosts(self) -> list[Any]:
        return [h for h, _ in self.worker_hosts.values()] + list(self.dock_hosts.values())

    def call(self, ref: Any, timeout_s: float = RPC_TIMEOUT_S) -> Any:
        return self.ray.get(ref, timeout=timeout_s)

    def spawn_worker(self, name: str, spec_bytes: bytes, spec_path: str, log_path: str,
                     env: dict[str, str]) -> RemoteProcess:
        host, node = self.worker_hosts[name]
        self.call(host.write_private.remote(spec_path, spec_bytes))
        pid, _ = self.call(host.spawn.remote(name, ["-m", "streamrl.runtime.worker", spec_path], env, log_path))
        proc = RemoteProcess(self, host, name, node, pid)
        self.processes = [p for p in self.processes if p.key != name] + [proc]
        return proc

    def host_pid(self, name: str) -> int:
        """The pid of the actor hosting process ``name`` (its children's ``parent_pid``)."""
        return self.host_pids[name]

    def start_monitor(self) -> None:
        """A thread that keeps every worker's exit code (or its host's death) current."""
        self._monitor = threading.Thread(target=self._watch, name="streamrl-ray-monitor", daemon=True)
        self._monitor.start()

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            if not self.ray.is_initialized():
                return  # never let a Ray call start a new local Ray (ray.get would, uninitialised)
            for proc in list(self.processes):
                if proc.exitcode is not None:
                    continue
                try:
                    codes = self.ray.get(proc.host.poll.remote(), timeout=RPC_TIMEOUT_S)
                except Exception as exc:  # RayActorError / ActorDiedError: the host, or its node, is gone
                    proc.lost = f"its Ray actor on {proc.node.describe()} died ({type(exc).__name__}: " \
                                f"{str(exc).splitlines()[0][:300] if str(exc) else ''})"
                    proc.exitcode = -int(signal.SIGKILL)
                    continue
                if codes.get(proc.key) is not None:
                    proc.exitcode = codes[proc.key]

    def close(self) -> None:
        """Stop every child, kill every actor, remove the placement group; nothing stays."""
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join(timeout=RPC_TIMEOUT_S)
        ray = self.ray
        if ray is None:
            return
        hosts = self.all_hosts()
        if hosts:
            refs = [h.stop.remote() for h in hosts]
            for ref in refs:
                with contextlib.suppress(Exception):
                    ray.get(ref, timeout=RPC_TIMEOUT_S)
            for h in hosts:
                with contextlib.suppress(Exception):
                    ray.kill(h, no_restart=True)
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self.pg)
        for proc in self.processes:
            if proc.exitcode is None:
                proc.exitcode = -int(signal.SIGTERM)
        if self.started_ray:
            ray.shutdown()


def _sum(bundles: list[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            total[k] = total.get(k, 0.0) + v
    return total


@dataclass
class RayDock:
    """The dock on a Ray cluster: the controller on the driver's node, a warehouse on each node
    that runs workers (``resources.ray.warehouse_per_node``), all on tcp with the run's CURVE keys.
    The same surface as :class:`streamrl.dock.launch.LocalDock` (``start``, ``stop``, ``alive``,
    ``controller_endpoint``)."""

    placement: RayPlacement
    consumers: list[str]
    capacity: int
    views: dict[str, Any]
    limits: Any  # streamrl.dock.limits.DockLimits
    auth: Any  # streamrl.security.RunCredentials (CURVE, the default on Ray, or PLAIN)
    log_dir: Path
    block: int = 4096
    per_node: bool = True
    start_timeout_s: float = 60.0
    log_level: str = "WARNING"
    policy: Any = None  # streamrl.dock.authz.DockPolicy: what each role may do (None: no authorization)
    controller_endpoint: str = ""
    warehouse_endpoints: list[str] = field(default_factory=list)
    servers: list[RemoteProcess] = field(default_factory=list)

    def start(self) -> RayDock:
        import msgspec

        from streamrl.dock.limits import SECRET_ENV, new_secret
        from streamrl.security import CLIENT_ENV, DOCK, SERVER_ENV

        pl = self.placement
        assert pl.driver_node is not None
        nodes = list(pl.nodes.values()) if self.per_node else [pl.driver_node]
        for w, node in enumerate(nodes):
            node.warehouse = w
        env = {SECRET_ENV: new_secret(), SERVER_ENV: self.auth.server().to_env(),
               CLIENT_ENV: self.auth.client(DOCK).to_env(), "STREAMRL_LOG": self.log_level,
               "PYTHONUNBUFFERED": "1"}
        views = ["--views", msgspec.json.encode(self.views).decode()] if self.views else []
        policy = ["--policy", msgspec.json.encode(self.policy).decode()] if self.policy else []
        host = pl.dock_host(pl.driver_node)
        host_pid = int(pl.call(host.info.remote())["pid"])
        pid, self.controller_endpoint = pl.call(host.spawn.remote(
            "controller",
            ["-m", "streamrl.dock.controller", "--bind", f"tcp://{pl.driver_node.ip}:0",
             "--consumers", ",".join(self.consumers), "--capacity", str(self.capacity),
             "--warehouses", str(len(nodes)), "--parent-pid", str(host_pid), "--block", str(self.block),
             *self.limits.argv(), *views, *policy],
            env, str(self.log_dir / "dock-controller.log"), self.start_timeout_s,
        ), timeout_s=self.start_timeout_s + RPC_TIMEOUT_S)
        self.servers.append(RemoteProcess(pl, host, "controller", pl.driver_node, pid))
        refs = []
        for w, node in enumerate(nodes):
            host = pl.dock_host(node)
            host_pid = int(pl.call(host.info.remote())["pid"])
            refs.append((node, host, host.spawn.remote(
                f"warehouse-{w}",
                ["-m", "streamrl.dock.warehouse", "--bind", f"tcp://{node.ip}:0",
                 "--controller", self.controller_endpoint, "--id", str(w), "--warehouses", str(len(nodes)),
                 "--parent-pid", str(host_pid), "--register-timeout", str(self.start_timeout_s),
                 "--block", str(self.block), *self.limits.argv(), *policy],
                env, str(self.log_dir / f"dock-warehouse-{w}.log"), self.start_timeout_s,
            )))
        for w, (node, host, ref) in enumerate(refs):
            pid, endpoint = pl.call(ref, timeout_s=self.start_timeout_s + RPC_TIMEOUT_S)
            self.warehouse_endpoints.append(endpoint)
            self.servers.append(RemoteProcess(pl, host, f"warehouse-{w}", node, pid))
        pl.processes.extend(self.servers)
        return self

    def alive(self) -> bool:
        return bool(self.servers) and all(p.exitcode is None for p in self.servers)

    def dead_server(self) -> str:
        """Which dock server ended, and where (for the launcher's message)."""
        for p in self.servers:
            if p.exitcode is not None:
                return f"dock {p.key} on {p.node.describe()} " + (p.lost or f"exited with code {p.exitcode}")
        return ""

    def stop(self, timeout_s: float = 10.0) -> None:
        """The dock's processes stop with their hosts (:meth:`RayPlacement.close`)."""
        for p in self.servers:
            p.send_signal(signal.SIGTERM)
