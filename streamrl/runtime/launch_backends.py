"""How a run's dock servers and worker processes come to exist, and go: one small interface,
three backends (``resources.launch``).

``processes`` (:class:`LocalProcesses`, default): controller, warehouses and every stage worker
are separate local processes, each in its own session so a Ctrl-C reaches only the launcher.
Workers fork from a forkserver that imported torch and the built-in stages once
(:mod:`streamrl.runtime.forkserver`). Every child also exits by itself if the launcher
disappears. ``inprocess`` (:class:`InProcessThreads`): the stage workers are tasks of the
launcher's event loop and the dock servers threads, for stepping through with a debugger.
``ray`` (:class:`RayLaunch`): the worker processes are children of Ray host actors on the nodes
Ray placed them on, and the dock's servers run on those nodes.

The launcher (:mod:`streamrl.runtime.launcher`) asks a backend for a dock, the endpoints of the
control and policy channels, and one worker process per process group; supervision
(:mod:`streamrl.runtime.supervision`) asks it to start a crashed process again.
"""

from __future__ import annotations

import abc
import contextlib
import multiprocessing
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import anyio
import anyio.abc
import msgspec

from streamrl import loop_affinity
from streamrl.config import RunConfig
from streamrl.dock.authz import DockPolicy
from streamrl.dock.controller import ConsumerView
from streamrl.dock.launch import LocalDock, ThreadDock
from streamrl.dock.limits import DockLimits
from streamrl.metrics.progress import Progress
from streamrl.runtime.forkserver import context, openmp_waits, use_private_temp_dir
from streamrl.runtime.orphans import claim_dir
from streamrl.runtime.pipeline import PipelineSpec, trainer_stages
from streamrl.runtime.ray_cluster import RayDock, RayPlacement, RemoteProcess, free_port
from streamrl.runtime.worker import WorkerSpec, run_worker, write_spec
from streamrl.security import RunCredentials, stage_role

Dock = LocalDock | ThreadDock | RayDock
Process = multiprocessing.process.BaseProcess | RemoteProcess


@dataclass
class _Worker:
    """One worker of one stage, and the process that runs it (shared with colocated workers)."""

    stage: str
    index: int
    log_path: Path | None = None
    proc: Process | None = None
    restartable: bool = False
    heartbeat: float = 0.0  # monotonic time of its last StageBusy
    in_batch_s: float = 0.0  # what that StageBusy said: seconds in the current batch (0 = between batches)


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Start a worker without re-importing the user's ``__main__`` in it.

    multiprocessing re-imports the parent's main script in every child (as ``__mp_main__``),
    which re-runs a script's top-level ``streamrl.run(...)`` when it lacks an
    ``if __name__ == "__main__":`` guard: nested runs. Workers never need the main module
    (stage classes are imported by ``module:Class``), so it is hidden while a child starts.
    """
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
    try:
        if main is not None:
            main.__dict__.pop("__file__", None)
            main.__dict__["__spec__"] = None
        yield
    finally:
        if main is not None:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)


def _worker_process(spec_path: str, log_path: str, environ: dict[str, str]) -> None:
    """Entry of a worker process (forked from the forkserver), with the launcher's environment
    as it was when the worker was started."""
    # The forkserver outlives a run (a notebook's or a test session's later runs fork from the same
    # one), and a fork copies the server's environment: the launcher's when the server started. A
    # variable set since (a key a reward function reads) must reach the worker as it would reach a
    # subprocess. Laid over, not swapped in: what the server's imports set (torch's inductor cache
    # directory) stays.
    os.environ.update(environ)
    os.setsid()  # own session: a Ctrl-C at the terminal reaches only the launcher
    # appended: a restarted worker, or a resumed run, keeps what the one before it wrote
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's stdout
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    from streamrl.runtime.worker import main

    code = main([spec_path])
    sys.stdout.flush()
    sys.stderr.flush()
    raise SystemExit(code)  # multiprocessing's bootstrap turns this into the exit code, with cleanup


def send_signal(proc: Process, sig: int) -> None:
    """A signal to a worker process, local or on a Ray node (through its host actor)."""
    if isinstance(proc, RemoteProcess):
        proc.send_signal(sig)
    elif proc.pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)


class LaunchBackend(abc.ABC):
    """Where the dock and the workers of one launch run. The launcher calls, in order:
    :meth:`connect`, :meth:`start_dock`, :meth:`endpoints`, :meth:`start` once per process group, then (in its
    ``finally``) :meth:`close`. Supervision calls :meth:`spawn` to restart a crashed process.

    ``processes``: process name (``generate-0``, ``generate-0+train-0`` when colocated) -> its
    workers and spec, for every worker process started (none for ``inprocess``).
    """

    parent_pid = 0  # the pid workers watch to exit with their launcher (0: none)

    def __init__(self, cfg: RunConfig, pipeline: PipelineSpec, run_dir: Path, progress: Progress,
                 tmp: str, shm: str) -> None:
        self.cfg = cfg
        self.pipeline = pipeline
        self.run_dir = run_dir
        self.progress = progress
        self.tmp = tmp  # this launcher's ipc directory
        self.shm = shm  # its shared-memory directory (= tmp where there is no /dev/shm)
        self.dock: Dock | None = None
        # the run's credentials, every launch mode: each server socket admits only the run's roles
        self.auth = RunCredentials.generate(self.mechanism(cfg), [stage_role(s.name) for s in pipeline.stages])
        self.processes: dict[str, tuple[list[_Worker], WorkerSpec]] = {}

    @staticmethod
    def mechanism(cfg: RunConfig) -> Literal["plain", "curve"]:
        """``resources.encryption``: auto is CURVE where sockets leave the host (ray), PLAIN otherwise."""
        enc = cfg.resources.encryption
        if enc == "auto":
            return "curve" if cfg.resources.launch == "ray" else "plain"
        return "curve" if enc == "curve" else "plain"

    def connect(self) -> None:
        """Join whatever the run's processes are placed on (blocking; :meth:`close` from another
        thread ends the wait). Called before :meth:`start_dock`."""
        return

    @abc.abstractmethod
    def start_dock(self, views: dict[str, ConsumerView], limits: DockLimits) -> Dock:
        """Create and start the dock's controller and warehouses (blocking: call it in a thread)."""

    def dock_policy(self) -> DockPolicy:
        """What each role may do in the dock, from the pipeline's stages (streamrl.dock.authz)."""
        # every launched run authenticates its sockets: a message without a role is refused
        return DockPolicy.from_stages(self.pipeline.stages, authenticated=self.auth is not None)

    def endpoints(self) -> tuple[str, str, str | None]:
        """Where the launcher's control channel binds, the trainer's policy channel, and the host
        a rendezvous store serves torch.distributed worlds on (None: FileStores in the run dir)."""
        return f"ipc://{self.tmp}/control", f"ipc://{self.tmp}/weights", None

    def started(self) -> None:
        """Every endpoint is up: begin watching whatever the backend watches (blocking)."""
        return

    async def start(self, members: list[_Worker], spec: WorkerSpec, tg: anyio.abc.TaskGroup) -> None:
        """Start the process (or task) of ``members``: a stage's worker and those colocated with it."""
        await anyio.to_thread.run_sync(self.spawn, members, spec)

    def spawn(self, members: list[_Worker], spec: WorkerSpec) -> None:
        """One process for ``members`` (blocking); also how a crashed one is started again."""
        logs = self.run_dir / "logs"
        logs.mkdir(exist_ok=True)
        name = "+".join(f"{w.stage}-{w.index}" for w in members)
        self.processes[name] = (members, spec)
        self._spawn(name, members, spec, logs / f"{name}.spec.json", logs / f"{name}.log")

    def _spawn(self, name: str, members: list[_Worker], spec: WorkerSpec, spec_path: Path, log_path: Path) -> None:
        raise NotImplementedError

    def pids(self) -> dict[str, Any]:
        """Every process of the run, and the ipc directories to remove if the launcher is killed
        (``logs/pids.json``)."""
        pids: dict[str, Any] = {"launcher": os.getpid(), "ipc": sorted({self.tmp, self.shm})}
        for name, (members, _) in self.processes.items():
            proc = members[0].proc
            if proc is not None and proc.pid is not None:
                pids[name] = proc.pid
        return pids

    def dock_dead(self) -> str | None:
        """Which dock server died (None: all alive, or nothing to watch)."""
        return None

    def placement(self) -> dict[str, str]:
        """Where each worker process and warehouse ran (only Ray places anything)."""
        return {}

    def close(self) -> None:
        """Stop the dock and whatever else the backend started (blocking)."""
        if self.dock is not None:
            self.dock.stop()


def loop_cores(cfg: RunConfig, pipeline: PipelineSpec) -> tuple[list[int | None], list[int | None]]:
    """The core of each local process's event loop (``resources.loop_affinity``), assigned in launch
    order: (the dock's servers, its controller first; one per process group of the pipeline). All
    None where the option is off or the host cannot pin."""
    servers = 1 + cfg.resources.dock.warehouses
    n = servers + len(pipeline.process_groups())
    every = loop_affinity.assign(n) if cfg.resources.loop_affinity else [None] * n
    return every[:servers], every[servers:]


class LocalProcesses(LaunchBackend):
    """``resources.launch: processes``: dock servers and workers as local processes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.parent_pid = os.getpid()
        use_private_temp_dir()  # before the forkserver starts (streamrl.run starts it with the first worker)

    def start_dock(self, views: dict[str, ConsumerView], limits: DockLimits) -> Dock:
        dc = self.cfg.resources.dock
        self.dock = LocalDock(self.pipeline.consumers, self.cfg.dock_capacity, dc.warehouses, dc.transport,
                              start_timeout_s=self.cfg.resources.start_timeout_s, limits=limits, views=views,
                              auth=self.auth, policy=self.dock_policy(),
                              loop_cores=loop_cores(self.cfg, self.pipeline)[0])
        self.dock.start()
        if self.dock._ipc_dir is not None:  # removed like the launcher's own if it is killed (runtime/orphans.py)
            claim_dir(self.dock._ipc_dir)
        return self.dock

    def _spawn(self, name: str, members: list[_Worker], spec: WorkerSpec, spec_path: Path, log_path: Path) -> None:
        write_spec(spec, spec_path)
        proc = context.Process(target=_worker_process, args=(str(spec_path), str(log_path), dict(os.environ)),
                              name=f"streamrl-{name}", daemon=False)
        for w in members:
            w.log_path, w.proc = log_path, proc
        with _main_module_hidden():
            proc.start()

    def pids(self) -> dict[str, Any]:
        pids = super().pids()
        if isinstance(self.dock, LocalDock):
            pids["dock"] = list(self.dock.pids)
            if self.dock._ipc_dir is not None:
                pids["ipc"].append(self.dock._ipc_dir)
        return pids

    def dock_dead(self) -> str | None:
        return None if self.dock is None or self.dock.alive() else "controller or warehouse"


class InProcessThreads(LaunchBackend):
    """``resources.launch: inprocess``: dock servers as threads, workers as tasks of this event loop."""

    def start_dock(self, views: dict[str, ConsumerView], limits: DockLimits) -> Dock:
        dc = self.cfg.resources.dock
        self.dock = ThreadDock(self.pipeline.consumers, self.cfg.dock_capacity, dc.warehouses, limits=limits,
                               views=views, auth=self.auth, policy=self.dock_policy())
        self.dock.start()
        return self.dock

    async def start(self, members: list[_Worker], spec: WorkerSpec, tg: anyio.abc.TaskGroup) -> None:
        tg.start_soon(run_worker, spec)


class RayLaunch(LaunchBackend):
    """``resources.launch: ray``: workers as children of Ray host actors, the dock on the nodes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ray: RayPlacement | None = None

    def connect(self) -> None:
        """Join the cluster (within ``resources.ray.connect_timeout_s``) or start a Ray for the run."""
        self.ray = RayPlacement(self.cfg.resources.ray, self.run_dir.name, self.cfg.resources.start_timeout_s)
        self.ray.connect()

    def start_dock(self, views: dict[str, ConsumerView], limits: DockLimits) -> Dock:
        """Place the worker processes, start the dock on the nodes."""
        cfg = self.cfg
        rc = cfg.resources.ray
        assert self.ray is not None, "connect() first"
        self.ray.place(self.pipeline, cfg.resources.device)
        where = ", ".join(f"{name} on {node.describe()}" for name, (_, node) in self.ray.worker_hosts.items())
        self.progress.message(f"streamrl: Ray placed {len(self.ray.worker_hosts)} worker processes on "
                              f"{len(self.ray.nodes)} node(s): {where}")
        self.dock = RayDock(self.ray, self.pipeline.consumers, cfg.dock_capacity, views, limits, self.auth,
                            self.run_dir / "logs", block=rc.dock_block, per_node=rc.warehouse_per_node,
                            start_timeout_s=cfg.resources.start_timeout_s, policy=self.dock_policy())
        self.dock.start()
        return self.dock

    def endpoints(self) -> tuple[str, str, str | None]:
        """The control channel binds on the driver node; the trainer's policy channel on its
        worker 0's node (a port free there now); the rendezvous store on the driver node's address."""
        assert self.ray is not None and self.ray.driver_node is not None
        # the built-in trainer (or a subclass) serves the policy channel from its worker 0
        trainers = trainer_stages(self.pipeline)
        publisher = next((name for name in self.ray.worker_hosts
                          for s in trainers if f"{s.name}-0" in name.split("+")), None)
        if publisher is None:  # no built-in trainer: serve the channel's address from the driver's node
            ip, port = self.ray.driver_node.ip, free_port(self.ray.driver_node.ip)
        else:
            host, node = self.ray.worker_hosts[publisher]
            ip, port = node.ip, int(self.ray.call(host.free_port.remote()))
        here = self.ray.driver_node.ip
        return f"tcp://{here}:0", f"tcp://{ip}:{port}", here

    def started(self) -> None:
        assert self.ray is not None
        self.ray.start_monitor()

    def _spawn(self, name: str, members: list[_Worker], spec: WorkerSpec, spec_path: Path, log_path: Path) -> None:
        """The process ``name`` as a child of its Ray host actor, on the node Ray placed it on:
        it watches that actor (``parent_pid``) and writes new samples to that node's warehouse."""
        assert self.ray is not None
        host, node = self.ray.worker_hosts[name]
        self.ray.call(host.make_dirs.remote([str(log_path.parent)], [self.tmp, self.shm]))
        spec = msgspec.structs.replace(spec, parent_pid=self.ray.host_pid(name), home_warehouse=node.warehouse)
        env = {"STREAMRL_LOG": os.environ.get("STREAMRL_LOG", "INFO"), **openmp_waits()}
        proc = self.ray.spawn_worker(name, msgspec.json.encode(spec), str(spec_path), str(log_path), env)
        for w in members:
            w.log_path, w.proc = log_path, proc

    def dock_dead(self) -> str | None:
        assert self.dock is None or isinstance(self.dock, RayDock)
        return None if self.dock is None or self.dock.alive() else self.dock.dead_server()

    def placement(self) -> dict[str, str]:
        if self.ray is None:
            return {}
        where = {name: node.describe() for name, (_, node) in self.ray.worker_hosts.items()}
        for node in self.ray.nodes.values():
            if node.warehouse is not None:
                where[f"warehouse-{node.warehouse}"] = node.describe()
        return where

    def close(self) -> None:
        super().close()
        if self.ray is not None:  # every child, actor and the placement group: nothing stays
            self.ray.close()


BACKENDS: dict[str, type[LaunchBackend]] = {"processes": LocalProcesses, "inprocess": InProcessThreads,
                                            "ray": RayLaunch}

