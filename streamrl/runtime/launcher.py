"""Launch a run: dock + one worker per stage replica, metrics, progress, clean shutdown.

``processes`` (default): controller, warehouses and every stage worker are separate local
processes started here, each in its own session so a Ctrl-C reaches only the launcher, which
then stops them in order (Stop, wait, SIGTERM, SIGKILL). Every child also exits by itself if
the launcher disappears. ``inprocess``: the stage workers are tasks of this process and the
dock servers threads, for stepping through with a debugger.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import msgspec

from streamrl.config import ConfigError, RunConfig, dump_config, load_config
from streamrl.curve import RunKeys
from streamrl.dock.controller import ConsumerView
from streamrl.dock.launch import LocalDock, ThreadDock
from streamrl.dock.limits import DockLimits
from streamrl.metrics.busy import BusyTracker
from streamrl.metrics.progress import Progress
from streamrl.metrics.trace import finish_trace
from streamrl.metrics.writer import MetricsWriter, plot_reward_curve
from streamrl.runtime import control as c
from streamrl.runtime.checkpoints import (
    CheckpointMissing,
    ResumeFrom,
    ResumeMismatch,
    complete_checkpoints,
    latest_checkpoint,
    resume_from,
)
from streamrl.runtime.pipeline import (
    PipelineSpec,
    _import_quietly,
    _is_trainer,
    load_pipeline,
    resolve_run_length,
)
from streamrl.runtime.ray_cluster import RayDock, RayPlacement, RemoteProcess, free_port
from streamrl.runtime.rendezvous import RendezvousServer
from streamrl.runtime.stage import StageError
from streamrl.runtime.worker import WorkerSpec, run_worker, write_spec

log = logging.getLogger("streamrl.launcher")


# Idle OpenMP threads of one stage must not spin while another stage computes: with the
# default (active) policy, generate and train on 2 cores slowed each other 5-50x here. Set
# before the forkserver starts (workers inherit it); a user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Workers fork from a server that imported these once: start-up costs one torch/transformers
# import instead of one per worker. Forking happens before any OpenMP pool or CUDA context exists
# (the server only imports), which is what makes fork safe here.
_PRELOAD = ["torch", "transformers", "streamrl.runtime.worker", "streamrl.stages.source", "streamrl.stages.generate",
            "streamrl.stages.score", "streamrl.stages.advantage", "streamrl.stages.reference",
            "streamrl.stages.train", "streamrl.stages.colocated", "streamrl.stages.disaggregated"]
_mp = multiprocessing.get_context("forkserver")
_mp.set_forkserver_preload(_PRELOAD)


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


def _worker_process(spec_path: str, log_path: str) -> None:
    """Entry of a worker process (forked from the forkserver)."""
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


SHM_DIR = "/dev/shm"  # a tmpfs on Linux: files there are memory, not disk
STOP_GRACE_S = 15.0  # after a stop request, how long workers get to close (checkpoint) before SIGTERM


SILENT_WORKER_S = 5.0  # a worker that sent no heartbeat for this long has a blocked event loop
STACK_DUMP_WAIT_S = 1.0  # after SIGUSR1, how long a worker gets to write its stacks to its log


def _send_signal(proc: multiprocessing.process.BaseProcess | RemoteProcess, sig: int) -> None:
    """A signal to a worker process, local or on a Ray node (through its host actor)."""
    if isinstance(proc, RemoteProcess):
        proc.send_signal(sig)
    elif proc.pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)


class RunFailed(RuntimeError):
    """The run stopped because a stage failed or a worker died; the message says which and where.

    ``resumable``: the failure was the run's machinery (a trainer or dock process died, a stall),
    not a stage's error, so resuming from the last checkpoint may get past it
    (``resources.auto_resume`` does that)."""

    def __init__(self, message: str, *, resumable: bool = False) -> None:
        super().__init__(message)
        self.resumable = resumable


class ResumeError(ConfigError):
    """``--resume`` cannot continue this run directory (no complete checkpoint, another batch shape),
    or a fresh run was pointed at a directory that holds one."""


@dataclass
class RunResult:
    run_dir: Path
    metrics: list[dict[str, Any]]
    steps: int
    stop_reason: str
    setup_s: float  # launch until every worker was set up (processes, imports, models)
    train_s: float  # Go until the end of the run
    total_s: float
    time_to_target_s: float | None  # Go until the first step with reward >= algo.stop_reward
    checkpoint: Path | None
    worker_logs: dict[str, Path] = field(default_factory=dict)
    eval_metrics: list[dict[str, Any]] = field(default_factory=list)  # eval rows (eval/... keys), in arrival order
    resumed_from: int | None = None  # the checkpoint's version this run continued from (--resume)
    restarts: dict[str, int] = field(default_factory=dict)  # "<stage>-<worker>" -> times it was restarted
    dock_statistics: dict[str, Any] = field(default_factory=dict)  # the controller's, at the end of training
    # the warehouses' statistics at the end of training (what each stored and served), by warehouse id
    warehouse_statistics: list[dict[str, Any]] = field(default_factory=list)
    # resources.launch: ray: where each worker process ran ("generate-0" -> "node 1a2b... (host, ip)")
    # and which dock warehouse lived on each node
    placement: dict[str, str] = field(default_factory=dict)

    @property
    def final_reward(self) -> float | None:
        return self.metrics[-1].get("reward_mean") if self.metrics else None


@dataclass
class _Worker:
    stage: str
    index: int
    log_path: Path | None = None
    proc: multiprocessing.process.BaseProcess | RemoteProcess | None = None
    restartable: bool = False
    heartbeat: float = 0.0  # monotonic time of its last StageBusy
    in_batch_s: float = 0.0  # what that StageBusy said: seconds in the current batch (0 = between batches)


def _new_run_dir(cfg: RunConfig) -> Path:
    base = Path(cfg.output.run_dir)
    if not base.is_absolute():
        base = Path.cwd() / base
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = base / f"{cfg.output.name}-{stamp}"
    k = 1
    while run_dir.exists():
        k += 1
        run_dir = base / f"{cfg.output.name}-{stamp}-{k}"
    run_dir.mkdir(parents=True)
    return run_dir


def run(config: str | Path | dict[str, Any] | RunConfig | None = None, overrides: list[str] | None = None,
        **kwargs: Any) -> RunResult:
    """Run a config to completion (blocking). See :func:`arun`."""
    return anyio.run(lambda: arun(config, overrides, **kwargs))


async def arun(config: str | Path | dict[str, Any] | RunConfig | None = None, overrides: list[str] | None = None,
               *, run_dir: str | Path | None = None, resume: str | Path | None = None) -> RunResult:
    """Validate the config and pipeline, launch everything, stream metrics, stop cleanly.

    ``resume=RUN_DIR`` continues that run from its newest complete checkpoint, in the same
    directory (``config`` defaults to the run's own config.yaml; ``overrides`` still apply).
    """
    t_launch = time.monotonic()
    if resume is not None:
        resume = Path(resume)
        if run_dir is not None and Path(run_dir).resolve() != resume.resolve():
            raise ResumeError(f"resume={str(resume)!r} continues in its own directory; run_dir={str(run_dir)!r} "
                              "differs: pass one of them")
        if config is None:
            config = resume / "config.yaml"
            if not config.is_file():
                raise ResumeError(f"{resume} is not a run directory (no config.yaml); pass the directory a run "
                                  "printed as its run dir")
        run_dir = resume
    if config is None:
        raise ConfigError("no config: pass a config file (or resume=RUN_DIR to continue a run)")
    cfg = resolve_run_length(load_config(config, overrides))
    pipeline = load_pipeline(cfg)
    rdir = Path(run_dir) if run_dir is not None else _new_run_dir(cfg)
    if resume is None and complete_checkpoints(rdir):
        raise ResumeError(
            f"{rdir} already holds checkpoint {latest_checkpoint(rdir).name} of an earlier run: continue it "  # type: ignore[union-attr]
            f"with `streamrl run --resume {rdir}` (streamrl.run(resume=...)), or start fresh in another directory "
            f"(or delete {rdir / 'checkpoints'})")
    rdir.mkdir(parents=True, exist_ok=True)
    (rdir / "config.yaml").write_text(dump_config(cfg))
    (rdir / "pipeline.yaml").write_text(Path(pipeline.path).read_text())
    resuming, automatic = resume is not None, 0
    while True:
        start = _checkpoint_to_resume(rdir, cfg) if resuming else None
        try:
            return await _Launch(cfg, pipeline, rdir, t_launch, start).run()
        except RunFailed as exc:
            if not exc.resumable or automatic >= cfg.resources.auto_resume or latest_checkpoint(rdir) is None:
                raise
            automatic += 1
            log.warning("run failed (%s); resuming from %s (automatic resume %d of %d)", exc,
                        latest_checkpoint(rdir), automatic, cfg.resources.auto_resume)
            resuming, t_launch = True, time.monotonic()


def truncate_metrics(path: Path, version: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Keep the rows of ``metrics.jsonl`` up to policy version ``version`` (rewritten atomically);
    returns the kept (train rows, eval rows). Rows past it belong to the interrupted run, whose
    steps after its checkpoint are trained again."""
    if not path.is_file():
        return [], []
    kept_lines, train, evals = [], [], []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by the crash
        if not isinstance(row, dict) or not isinstance(row.get("step"), int) or row["step"] > version:
            continue
        kept_lines.append(line)
        (evals if any(k.startswith("eval/") for k in row) else train).append(row)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept_lines))
    tmp.replace(path)
    return train, evals


def _remove_stale_ipc(run_dir: Path) -> None:
    """The ipc directories an earlier launcher of this run directory recorded in logs/pids.json,
    when that launcher is gone (killed: it could not clean up after itself)."""
    from streamrl.runtime.worker import process_alive

    try:
        pids = json.loads((run_dir / "logs" / "pids.json").read_text())
    except (OSError, ValueError):
        return
    launcher = pids.get("launcher")
    if not isinstance(launcher, int) or launcher == os.getpid() or process_alive(launcher):
        return
    for d in pids.get("ipc", []):
        if isinstance(d, str) and Path(d).parent in (Path("/tmp"), Path(SHM_DIR)) and Path(d).name.startswith("srl"):
            shutil.rmtree(d, ignore_errors=True)


def _checkpoint_to_resume(run_dir: Path, cfg: RunConfig) -> ResumeFrom:
    try:
        return resume_from(run_dir, cfg.batch_size, cfg.algo.group_size)
    except (CheckpointMissing, ResumeMismatch) as exc:
        raise ResumeError(str(exc)) from None


class _Launch:
    def __init__(self, cfg: RunConfig, pipeline: PipelineSpec, run_dir: Path, t_launch: float,
                 resume: ResumeFrom | None = None) -> None:
        self.cfg = cfg
        self.pipeline = pipeline
        self.run_dir = run_dir
        self.t_launch = t_launch
        self.resume = resume
        self.workers = [_Worker(s.name, k, restartable=s.restartable) for s in pipeline.stages
                        for k in range(s.workers)]
        self.progress = Progress(cfg.algo.steps, cfg.output.progress, stop_reward=cfg.algo.stop_reward)
        self.train_rows: list[dict[str, Any]] = []
        self.eval_rows: list[dict[str, Any]] = []
        resumed_at = resume.state.version if resume is not None else None
        if resumed_at is not None:
            # the rows up to the checkpoint stay; later ones were the dead run's and come again
            self.train_rows, self.eval_rows = truncate_metrics(run_dir / "metrics.jsonl", resumed_at)
            self.progress.message(f"streamrl: resuming {run_dir} from {Path(resume.path).name} "  # type: ignore[union-attr]
                                  f"(version {resumed_at})")
        self.metrics = MetricsWriter(run_dir, tensorboard=cfg.output.tensorboard, wandb=cfg.output.wandb,
                                     run_config=msgspec.to_builtins(cfg),
                                     purge_step=resumed_at + 1 if resumed_at is not None else None)
        self.busy = BusyTracker({s.name: s.workers for s in pipeline.stages})
        self.stage_metrics: dict[tuple[str, int], dict[str, float]] = {}
        self.specs: dict[str, tuple[list[_Worker], WorkerSpec]] = {}  # process name -> its workers and spec
        self.restarts: dict[str, int] = {}
        self.term_requested = False
        self.dock_statistics: dict[str, Any] = {}
        self.t_progress = 0.0  # the last optimizer step (or Go)
        self.finished: set[tuple[str, int]] = set()
        self.tmp = ""  # this launcher's ipc directory
        self.shm = ""  # this launcher's shared-memory directory (= tmp where there is no /dev/shm)
        self.t_last_step = 0.0
        self.t_go = 0.0
        self.time_to_target: float | None = None
        self.failure: c.Failed | None = None
        self.death: str | None = None
        self.resumable = False
        self.stop_reason = ""
        self.t_end: float | None = None
        self.dock: LocalDock | ThreadDock | RayDock | None = None
        self.ray: RayPlacement | None = None  # resources.launch: ray
        self.curve: RunKeys | None = None  # the run's CURVE keys (ray: every socket leaves the host)
        self.warehouse_statistics: list[dict[str, Any]] = []

    def _start_ray(self, views: dict[str, ConsumerView], limits: DockLimits) -> RayDock:
        """Connect to (or start) Ray, place the worker processes, start the dock on the nodes."""
        cfg = self.cfg
        rc = cfg.resources.ray
        self.ray = RayPlacement(rc, self.run_dir.name, cfg.resources.start_timeout_s)
        self.ray.connect()
        self.ray.place(self.pipeline, cfg.resources.device)
        self.curve = RunKeys.generate()
        where = ", ".join(f"{name} on {node.describe()}" for name, (_, node) in self.ray.worker_hosts.items())
        self.progress.message(f"streamrl: Ray placed {len(self.ray.worker_hosts)} worker processes on "
                              f"{len(self.ray.nodes)} node(s): {where}")
        return RayDock(self.ray, self.pipeline.consumers, cfg.dock_capacity, views, limits, self.curve,
                       self.run_dir / "logs", block=rc.dock_block, per_node=rc.warehouse_per_node,
                       start_timeout_s=cfg.resources.start_timeout_s)

    def _ray_endpoints(self) -> tuple[str, str, str]:
        """Where the launcher's control channel binds, the trainer's policy channel (its worker
        0's node, a port free there now), and the driver node's address (the rendezvous store's)."""
        assert self.ray is not None and self.ray.driver_node is not None
        # the built-in trainer (or a subclass) serves the policy channel from its worker 0
        trainers = [s for s in self.pipeline.stages if _is_trainer(_import_quietly(s.cls))]
        publisher = next((name for name in self.ray.worker_hosts
                          for s in trainers if f"{s.name}-0" in name.split("+")), None)
        if publisher is None:  # no built-in trainer: serve the channel's address from the driver's node
            ip, port = self.ray.driver_node.ip, free_port(self.ray.driver_node.ip)
        else:
            host, node = self.ray.worker_hosts[publisher]
            ip, port = node.ip, int(self.ray.call(host.free_port.remote()))
        here = self.ray.driver_node.ip
        return f"tcp://{here}:0", f"tcp://{ip}:{port}", here

    async def run(self) -> RunResult:
        cfg = self.cfg
        _remove_stale_ipc(self.run_dir)  # a killed run of this directory could not remove its own
        # ipc endpoints live in a short private dir (socket paths are limited to ~100 bytes)
        tmp = self.tmp = tempfile.mkdtemp(prefix="srl-", dir="/tmp")
        # shared-memory scratch (e.g. vLLM's weight files between processes), removed like tmp
        self.shm = tempfile.mkdtemp(prefix="srl-", dir=SHM_DIR) if Path(SHM_DIR).is_dir() else tmp
        dock: LocalDock | ThreadDock
        dc = cfg.resources.dock
        limits = DockLimits(dc.max_message_mib, dc.max_header_mib, dc.max_clients, dc.max_parked)
        # each consumer's reads are fixed from the pipeline, so no claim (from any client) can set them
        views = {s.name: ConsumerView(list(s.reads), s.whole_groups) for s in self.pipeline.stages if s.reads}
        server: c.ControlServer | None = None
        rendezvous: RendezvousServer | None = None
        dock: LocalDock | ThreadDock | RayDock | None = None
        try:
            self.progress.message(f"streamrl: run dir {self.run_dir}")
            if cfg.resources.launch == "ray":
                dock = await anyio.to_thread.run_sync(self._start_ray, views, limits)
            elif cfg.resources.launch == "processes":
                dock = LocalDock(self.pipeline.consumers, cfg.dock_capacity, dc.warehouses, dc.transport,
                                 start_timeout_s=cfg.resources.start_timeout_s, limits=limits, views=views)
            else:
                dock = ThreadDock(self.pipeline.consumers, cfg.dock_capacity, dc.warehouses, limits=limits,
                                  views=views)
            self.dock = dock
            await anyio.to_thread.run_sync(dock.start)
            token = c.new_token()
            control, weights = f"ipc://{tmp}/control", f"ipc://{tmp}/weights"
            if self.ray is not None:
                control, weights, here = await anyio.to_thread.run_sync(self._ray_endpoints)
                rendezvous = RendezvousServer(here, timeout_s=cfg.resources.start_timeout_s)
                self.ray.start_monitor()
            server = c.ControlServer(control, token=token, workers={(w.stage, w.index) for w in self.workers},
                                     curve=self.curve)
            # colocated and disaggregated stages join torch.distributed through FileStores here
            (self.run_dir / "rendezvous").mkdir(exist_ok=True)
            async with anyio.create_task_group() as tg:
                for group in self.pipeline.process_groups():
                    (host, k), rest = group[0], group[1:]
                    spec = WorkerSpec(config=cfg, stage=host, worker=k, colocated=[s for s, _ in rest],
                                      dock_endpoint=dock.controller_endpoint, control_endpoint=server.endpoint,
                                      weights_endpoint=weights, run_dir=str(self.run_dir), pipeline=self.pipeline,
                                      token=token, resume=self.resume, scratch_dir=tmp, shm_dir=self.shm,
                                      parent_pid=os.getpid() if cfg.resources.launch == "processes" else 0,
                                      curve=self.curve,
                                      rendezvous_endpoint=rendezvous.endpoint if rendezvous is not None else "")
                    members = [w for w in self.workers if (w.stage, w.index) in {(s.name, i) for s, i in group}]
                    if cfg.resources.launch != "inprocess":
                        await anyio.to_thread.run_sync(self._spawn, members, spec)
                    else:
                        tg.start_soon(run_worker, spec)
                # One task owns the socket's receive: a recv cancelled by the supervisor's poll timeout
                # could drop a message that had just arrived (e.g. the last Finished: the run would
                # then wait forever); a memory stream's receive loses nothing when cancelled.
                events_in, events = anyio.create_memory_object_stream[c.WorkerEvent | None](10_000)
                tg.start_soon(self._pump_events, server, events_in)
                tg.start_soon(self._watch_sigterm)
                self._write_pids()
                await self._supervise(server, events)
                self.t_end = time.monotonic()  # training ends here; shutdown is not training time
                self.dock_statistics, self.warehouse_statistics = await self._dock_statistics(
                    dock.controller_endpoint)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                if server is None:
                    await anyio.to_thread.run_sync(self._reap)
                else:
                    stop = c.Stop(self.stop_reason or "launcher stopping")
                    await server.broadcast(stop)
                    async with anyio.create_task_group() as reaping:
                        reaping.start_soon(self._stop_late_workers, server, stop)
                        await anyio.to_thread.run_sync(self._reap)
                        reaping.cancel_scope.cancel()
                if server is not None:
                    server.close()
                if dock is not None:
                    dock.stop()
                if self.ray is not None:  # every child, actor and the placement group: nothing stays
                    await anyio.to_thread.run_sync(self.ray.close)
                if rendezvous is not None:
                    rendezvous.close()
                shutil.rmtree(tmp, ignore_errors=True)
                shutil.rmtree(self.shm, ignore_errors=True)
                shutil.rmtree(self.run_dir / "rendezvous", ignore_errors=True)
                self.progress.close()
                self.metrics.close()
                await anyio.to_thread.run_sync(finish_trace, self.run_dir, cfg.output.trace)  # trace.json
        return self._result()

    def _spawn(self, members: list[_Worker], spec: WorkerSpec) -> None:
        """One process for ``members`` (a stage's worker and the workers colocated with it)."""
        logs = self.run_dir / "logs"
        logs.mkdir(exist_ok=True)
        name = "+".join(f"{w.stage}-{w.index}" for w in members)
        self.specs[name] = (members, spec)
        spec_path = logs / f"{name}.spec.json"
        log_path = logs / f"{name}.log"
        if self.ray is not None:
            self._spawn_on_ray(members, spec, name, spec_path, log_path)
            return
        write_spec(spec, spec_path)
        proc = _mp.Process(target=_worker_process, args=(str(spec_path), str(log_path)),
                           name=f"streamrl-{name}", daemon=False)
        for w in members:
            w.log_path, w.proc = log_path, proc
        with _main_module_hidden():
            proc.start()

    def _spawn_on_ray(self, members: list[_Worker], spec: WorkerSpec, name: str, spec_path: Path,
                      log_path: Path) -> None:
        """The process ``name`` as a child of its Ray host actor, on the node Ray placed it on:
        it watches that actor (``parent_pid``) and writes new samples to that node's warehouse."""
        assert self.ray is not None
        host, node = self.ray.worker_hosts[name]
        self.ray.call(host.make_dirs.remote([str(log_path.parent)], [self.tmp, self.shm]))
        spec = msgspec.structs.replace(spec, parent_pid=self.ray.host_pid(name), home_warehouse=node.warehouse)
        env = {"STREAMRL_LOG": os.environ.get("STREAMRL_LOG", "INFO"), "OMP_WAIT_POLICY": "PASSIVE"}
        proc = self.ray.spawn_worker(name, msgspec.json.encode(spec), str(spec_path), str(log_path), env)
        for w in members:
            w.log_path, w.proc = log_path, proc

    def _write_pids(self) -> None:
        """``logs/pids.json``: every process of the run (for operators: ``kill -USR1`` dumps a
        worker's stacks into its log; and for fault-injection tests)."""
        pids: dict[str, Any] = {"launcher": os.getpid(), "ipc": sorted({self.tmp, self.shm})}
        if isinstance(self.dock, LocalDock):
            pids["dock"] = list(self.dock.pids)
            if self.dock._ipc_dir is not None:
                pids["ipc"].append(self.dock._ipc_dir)
        for name, (members, _) in self.specs.items():
            proc = members[0].proc
            if proc is not None and proc.pid is not None:
                pids[name] = proc.pid
        logs = self.run_dir / "logs"
        logs.mkdir(exist_ok=True)
        tmp = logs / "pids.json.tmp"
        tmp.write_text(json.dumps(pids, indent=1))
        tmp.replace(logs / "pids.json")

    def _resume_hint(self) -> str:
        if not self.cfg.output.checkpoint_every:
            return "this run saved no checkpoint (output.checkpoint_every: 0), so it cannot be resumed"
        found = latest_checkpoint(self.run_dir)
        where = f"its newest checkpoint is {found.name}" if found else "it has no complete checkpoint yet"
        return f"resume it with: streamrl run --resume {self.run_dir} ({where})"

    def _check_processes(self, stopping: bool) -> None:
        if isinstance(self.dock, LocalDock | RayDock) and not self.dock.alive() and self.death is None:
            which = self.dock.dead_server() if isinstance(self.dock, RayDock) else "controller or warehouse"
            self.death = (f"a dock server process died ({which}); the run cannot continue; " + self._resume_hint())
            self.resumable = True
        for name, (members, spec) in list(self.specs.items()):
            proc = members[0].proc
            if proc is None or proc.exitcode in (None, 0) or self.death is not None:
                continue
            code = proc.exitcode
            lost = getattr(proc, "lost", None)  # a Ray host actor (or its whole node) died
            how = f"was lost: {lost}" if lost else \
                f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            if isinstance(proc, RemoteProcess):
                how += f" (on {proc.node.describe()})"
            # code 1: the stage raised and reported it (Failed): an error, not a crash to retry
            if code != 1 and not lost and not stopping and all(w.restartable for w in members) \
                    and self.restarts.get(name, 0) < self.cfg.resources.max_restarts:
                self.restarts[name] = self.restarts.get(name, 0) + 1
                ttl = self.cfg.resources.dock.lease_ttl_s
                self.progress.message(
                    f"streamrl: {name} {how}; restarting it ({self.restarts[name]} of resources.max_restarts="
                    f"{self.cfg.resources.max_restarts}); its leased samples go back to the dock within "
                    f"resources.dock.lease_ttl_s={ttl:g} s")
                log.warning("%s %s; restarting it", name, how)
                proc.close()
                self._spawn(members, spec)
                self._write_pids()
                continue
            w = members[0]
            # a process that died (not a stage that raised: that arrives as Failed) is the run's
            # machinery failing: resuming from the last checkpoint may get past it
            self.resumable = True
            extra = ""
            if code != 1 and w.restartable and not stopping:
                extra = f" (restarted {self.restarts.get(name, 0)} times already: resources.max_restarts)"
            self.death = f"stage {w.stage!r} worker {w.index} {how}{extra}; its log: {w.log_path}; {self._resume_hint()}"

    @staticmethod
    async def _stop_late_workers(server: c.ControlServer, stop: c.Stop) -> None:
        """While reaping: a worker that connects only now (it was still starting when the run
        ended, so the broadcast missed it) gets Stop too, instead of waiting out the reap's grace."""
        while True:
            event = await server.recv()
            if isinstance(event, c.Starting | c.Ready):
                await server.broadcast(stop)

    @staticmethod
    async def _pump_events(server: c.ControlServer,
                           events: anyio.abc.ObjectSendStream[c.WorkerEvent | None]) -> None:
        async with events:
            while True:
                await events.send(await server.recv())

    async def _supervise(self, server: c.ControlServer,
                         events: anyio.abc.ObjectReceiveStream[c.WorkerEvent | None]) -> None:
        expected = {(w.stage, w.index) for w in self.workers}
        by_key = {(w.stage, w.index): w for w in self.workers}
        ready: set[tuple[str, int]] = set()
        finished = self.finished
        deadline = time.monotonic() + self.cfg.resources.start_timeout_s
        stop_deadline: float | None = None
        term_deadline: float | None = None
        went = False
        while True:
            event = None
            with anyio.move_on_after(0.2):
                event = await events.receive()
            self._check_processes(stopping=stop_deadline is not None or term_deadline is not None)
            match event:
                case c.Ready(stage=s, worker=k):
                    ready.add((s, k))
                    if went:  # a restarted worker: the run is under way
                        await server.send_to((s, k), c.Go())
                case c.StageBusy(stage=s, worker=k, busy_s=b, in_batch_s=in_batch, measured_at=at):
                    self.busy.report(s, k, b, in_batch, at)
                    w = by_key[(s, k)]
                    w.heartbeat, w.in_batch_s = time.monotonic(), in_batch
                case c.StageMetrics(stage=s, worker=k, metrics=m):
                    # merged: a stage reports different figures at different times (engine start-up once,
                    # each weight install later), and each stays in the rows until it reports it again
                    self.stage_metrics.setdefault((s, k), {}).update(m)
                case c.StepReport(step=step, metrics=m, measured_at=at):
                    self._on_step(step, m, at)
                case c.EvalReport(step=step, metrics=m):
                    self._on_eval(step, m)
                case c.Failed():
                    self.failure = event
                case c.StopRequest(reason=reason):
                    self.stop_reason = reason
                    await server.broadcast(c.Stop(reason))
                    stop_deadline = time.monotonic() + self._stop_grace_s()
                case c.Finished(stage=s, worker=k):
                    finished.add((s, k))
            if self.death is not None and self.failure is None:
                await self._drain_for_failure(events)
            if self.failure is not None or self.death is not None:
                return
            if self.term_requested and term_deadline is None and stop_deadline is None:
                term_deadline = time.monotonic() + self._term_grace_s()
                self.progress.message("streamrl: SIGTERM: saving a checkpoint after the current step, then stopping "
                                      "(SIGTERM again, or Ctrl-C, stops at once)")
                await server.broadcast(c.Save("SIGTERM"))
            if term_deadline is not None and stop_deadline is None and time.monotonic() > term_deadline:
                self.stop_reason = "SIGTERM (no step ended in time to save a checkpoint)"
                self.progress.message(f"streamrl: no step ended within {self._term_grace_s():.0f} s of SIGTERM; "
                                      f"stopping without a new checkpoint ({self._resume_hint()})")
                return
            if not went and ready == expected:
                went = True
                self.t_go = self.t_last_step = self.t_progress = time.monotonic()
                self.progress.message(f"streamrl: {len(expected)} workers ready in "
                                      f"{self.t_go - self.t_launch:.1f} s; training")
                await server.broadcast(c.Go())
            if went and stop_deadline is None and self._stalled():
                await self._report_stall()
                return
            if not went and time.monotonic() > deadline:
                missing = sorted(expected - ready)
                raise RunFailed(f"workers {missing} did not finish setup within resources.start_timeout_s="
                                f"{self.cfg.resources.start_timeout_s} s; see {self.run_dir / 'logs'}")
            for w in self.workers:  # a clean exit counts as finished even if its message was lost
                if w.proc is not None and w.proc.exitcode == 0:
                    finished.add((w.stage, w.index))
            if finished == expected and not server.pending(events):  # their last events read first
                self.stop_reason = self.stop_reason or "all stages finished"
                return
            if stop_deadline is not None and time.monotonic() > stop_deadline:
                late = sorted(expected - finished)
                log.warning("workers %s did not finish within %.0f s of Stop; stopping them", late, STOP_GRACE_S)
                self.progress.message(f"streamrl: workers {late} did not finish within {STOP_GRACE_S:.0f} s of "
                                      "Stop; stopping them (see their logs)")
                return  # stragglers are reaped below

    def _term_grace_s(self) -> float:
        """After SIGTERM, how long the current step (and its save) may take: a step is checked
        against the stall timeout anyway."""
        return self.cfg.resources.stall_timeout_s or 600.0

    async def _watch_sigterm(self) -> None:
        """SIGTERM with checkpoints on: save after the current step, then stop (a second one, or
        none of that configured: stop at once, as Ctrl-C does). Only the main thread gets signals."""
        if threading.current_thread() is not threading.main_thread():
            return
        with anyio.open_signal_receiver(signal.SIGTERM) as signals:
            async for _ in signals:
                if self.term_requested or not self.cfg.output.checkpoint_every or not self.t_go:
                    signal.raise_signal(signal.SIGINT)  # the event loop turns it into a clean cancellation
                    return
                self.term_requested = True

    def _stalled(self) -> bool:
        limit = self.cfg.resources.stall_timeout_s
        if not limit:
            return False
        first = self.t_progress == self.t_go  # no step yet in this launch (fresh or resumed)
        return time.monotonic() - self.t_progress > (2 * limit if first else limit)

    async def _report_stall(self) -> None:
        """No step for stall_timeout_s: name the workers that look stuck, with their Python stacks."""
        now = time.monotonic()
        idle_s = now - self.t_progress
        running = [w for w in self.workers if (w.stage, w.index) not in self.finished
                   and (w.proc is None or w.proc.exitcode is None)]
        silent = [w for w in running if now - w.heartbeat > SILENT_WORKER_S]
        busy = [w for w in running if w.in_batch_s > 0 and w.in_batch_s + (now - w.heartbeat) > idle_s / 2
                and w not in silent]
        suspects = silent + busy or running
        stacks = await anyio.to_thread.run_sync(self._dump_stacks, suspects)
        lines = []
        for w in suspects:
            if w in silent:
                why = f"sent nothing for {now - w.heartbeat:.0f} s (its event loop is blocked)"
            elif w in busy:
                why = f"has been in one batch for {w.in_batch_s + now - w.heartbeat:.0f} s"
            else:
                why = "is waiting"
            lines.append(f"stage {w.stage!r} worker {w.index} {why}; log: {w.log_path}\n{stacks.get(id(w), '')}")
        self.death = (f"no optimizer step for {idle_s:.0f} s (resources.stall_timeout_s="
                      f"{self.cfg.resources.stall_timeout_s:g}); stopping the run. " + "\n".join(lines)
                      + f"\n{self._resume_hint()}")
        self.resumable = True
        log.error("%s", self.death)

    def _dump_stacks(self, workers: list[_Worker]) -> dict[int, str]:
        """SIGUSR1 to each worker's process (faulthandler writes its threads' stacks to its log),
        then the new text of each log."""
        sizes = {}
        for w in workers:
            if w.proc is not None and w.proc.pid is not None and w.log_path is not None and w.proc.is_alive():
                sizes[id(w)] = w.log_path.stat().st_size if w.log_path.exists() else 0
                _send_signal(w.proc, signal.SIGUSR1)
        if not sizes:  # inprocess: the workers are this process's tasks
            import faulthandler

            with tempfile.TemporaryFile("w+") as f:  # faulthandler writes to a file descriptor
                faulthandler.dump_traceback(file=f, all_threads=True)
                f.seek(0)
                text = f.read()[-6000:]
            return {id(w): text for w in workers}
        time.sleep(STACK_DUMP_WAIT_S)
        out = {}
        for w in workers:
            if id(w) in sizes and w.log_path is not None:
                with w.log_path.open("rb") as f:
                    f.seek(sizes[id(w)])
                    out[id(w)] = f.read().decode(errors="replace")[-6000:]
        return out

    async def _dock_statistics(self, endpoint: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The controller's and the warehouses' counters once training ended (what reached each
        stage, what each warehouse stored and served), for the result."""
        from streamrl.dock.client import DockClient

        try:
            with anyio.fail_after(3):
                async with DockClient(endpoint, client_id="launcher-stats", connect_timeout_s=2,
                                      request_timeout_s=2, curve=self.curve) as dock:
                    stats = await dock.server_statistics()
            return dict(stats["controller"]), list(stats.get("warehouses", []))
        except Exception as exc:  # the dock died (that is reported on its own): no figures
            log.info("no dock statistics at the end: %s", exc)
            return {}, []

    def _stop_grace_s(self) -> float:
        """How long workers get to finish after a stop request: the final evaluation (eval.at_end)
        runs then, in the eval stage's close, and may take longer than a checkpoint."""
        side = any(s.is_side for s in self.pipeline.stages)
        return max(STOP_GRACE_S, self.cfg.eval.end_timeout_s if side and self.cfg.eval.at_end else 0.0)

    async def _drain_for_failure(self, events: anyio.abc.ObjectReceiveStream[c.WorkerEvent | None],
                                 wait_s: float = 1.0) -> None:
        """A worker process ended badly: its ``Failed`` (sent just before it exited) may still be
        queued. Read what is there, so the run reports the stage's own error, not only the exit code."""
        with anyio.move_on_after(wait_s):
            while self.failure is None:
                event = await events.receive()
                if isinstance(event, c.Failed):
                    self.failure = event

    def _on_step(self, step: int, metrics: dict[str, float], measured_at: float = 0.0) -> None:
        now = time.monotonic()
        self.t_progress = now
        row: dict[str, Any] = {"step": step, **metrics, "elapsed_s": round(now - self.t_go, 4)}
        wall_now = time.time()  # busy/<stage>: the fraction of the step's wall time each stage worked
        row.update(self.busy.step(measured_at or wall_now, go=wall_now - (now - self.t_go)))
        for (stage, k), values in sorted(self.stage_metrics.items()):
            for name, v in values.items():
                key = f"{stage}/{name}" if self.pipeline.stage(stage).workers == 1 else f"{stage}/{k}/{name}"
                row[key] = v
        for name, n in sorted(self.restarts.items()):
            row[f"restarts/{name}"] = n
        self.t_last_step = now
        target = self.cfg.algo.stop_reward
        if target is not None and self.time_to_target is None and metrics.get("reward_mean", -1e9) >= target:
            self.time_to_target = now - self.t_go
        self.train_rows.append(row)
        self.metrics.write(row)
        self.progress.update(row)

    def _on_eval(self, step: int, metrics: dict[str, float]) -> None:
        """An evaluation of policy version ``step``: a row of its own (no training figures)."""
        row: dict[str, Any] = {"step": step, **{f"eval/{k}": v for k, v in metrics.items()},
                               "elapsed_s": round(time.monotonic() - self.t_go, 4)}
        self.eval_rows.append(row)
        self.metrics.write(row)
        shown = ", ".join(f"{k} {v:.3f}" for k, v in metrics.items() if "@" in k)  # mean@k, pass@k
        self.progress.message(f"streamrl: eval of version {step}: {shown}")

    def _reap(self) -> None:
        """Wait for workers to exit after Stop; SIGTERM, then SIGKILL, whoever lingers."""
        procs = list({id(w.proc): w.proc for w in self.workers if w.proc is not None}.values())
        for sig, wait in ((None, 30.0), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            alive = [p for p in procs if p.is_alive()]
            if not alive:
                break
            for p in alive:
                if sig is not None:
                    _send_signal(p, sig)
            deadline = time.monotonic() + wait
            for p in alive:
                p.join(timeout=max(0.05, deadline - time.monotonic()))
        for p in procs:
            if not p.is_alive():
                p.close()

    def _result(self) -> RunResult:
        now = self.t_end or time.monotonic()
        logs = {f"{w.stage}-{w.index}": w.log_path for w in self.workers if w.log_path is not None}
        if self.failure is not None:
            f = self.failure
            tail = "\n".join(f.traceback.strip().splitlines()[-12:])
            raise StageError(f.stage, f.worker, f.indices, f"{f.message.split(': ', 1)[-1]}\n{tail}")
        if self.death is not None:
            raise RunFailed(self.death, resumable=self.resumable)
        rows = self.train_rows
        if self.cfg.output.plot and rows:
            plot_reward_curve(rows, self.run_dir / "reward_curve.png", title=self.cfg.output.name)
        ckpt = self.run_dir / "checkpoint"
        setup = (self.t_go or now) - self.t_launch
        self.progress.message(
            f"streamrl: {len(rows)} steps, final reward {rows[-1].get('reward_mean', float('nan')):.3f}, "
            f"setup {setup:.1f} s + training {now - (self.t_go or now):.1f} s ({self.stop_reason}); "
            f"outputs in {self.run_dir}" if rows else f"streamrl: no step completed ({self.stop_reason})"
        )
        return RunResult(
            run_dir=self.run_dir, metrics=rows, steps=len(rows), stop_reason=self.stop_reason, setup_s=setup,
            train_s=now - (self.t_go or now), total_s=time.monotonic() - self.t_launch,
            time_to_target_s=self.time_to_target,
            checkpoint=ckpt if ckpt.is_dir() else None, worker_logs=logs, eval_metrics=self.eval_rows,
            resumed_from=self.resume.state.version if self.resume is not None else None,
            restarts=dict(self.restarts), dock_statistics=self.dock_statistics,
            warehouse_statistics=self.warehouse_statistics, placement=self._placement(),
        )

    def _placement(self) -> dict[str, str]:
        if self.ray is None:
            return {}
        where = {name: node.describe() for name, (_, node) in self.ray.worker_hosts.items()}
        for node in self.ray.nodes.values():
            if node.warehouse is not None:
                where[f"warehouse-{node.warehouse}"] = node.describe()
        return where
