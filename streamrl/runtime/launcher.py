"""Launch a run: dock + one worker per stage replica, metrics, progress, clean shutdown.

:func:`run` / :func:`arun` validate the config and pipeline, prepare the run directory (or
continue one: ``resume``), and launch; a resumable failure is launched again from the newest
checkpoint (``resources.auto_resume``). One launch (:class:`_Launch`) puts together:

- a launch backend (:mod:`streamrl.runtime.launch_backends`): where the dock servers and the
  worker processes run (``resources.launch``: local ``processes``, ``inprocess`` tasks and
  threads, or ``ray``);
- supervision (:mod:`streamrl.runtime.supervision`): the start barrier, the workers' events,
  restarts, stalls, SIGTERM, and stopping everything in order (Stop, wait, SIGTERM, SIGKILL);
- the run's metrics (:mod:`streamrl.runtime.run_metrics`): step and eval rows and their sinks;
- the live status page (:mod:`streamrl.runtime.status_page`, ``output.status_page``).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from streamrl import event_loop
from streamrl.config import ConfigError, RunConfig, dump_config, load_config
from streamrl.dock.controller import ConsumerView
from streamrl.dock.limits import DockLimits
from streamrl.metrics.progress import Progress
from streamrl.metrics.report import import_plotting
from streamrl.metrics.trace import finish_trace
from streamrl.metrics.writer import plot_reward_curve
from streamrl.runtime import control as c
from streamrl.runtime.checkpoints import (
    CheckpointMissing,
    ResumeFrom,
    ResumeMismatch,
    complete_checkpoints,
    latest_checkpoint,
    resume_from,
)
from streamrl.runtime.forkserver import start_forkserver, stop_forkserver
from streamrl.runtime.launch_backends import BACKENDS, LaunchBackend, _Worker, loop_cores
from streamrl.runtime.orphans import SHM_DIR, make_private_dir, process_alive, remove_dead_owners
from streamrl.runtime.pipeline import PipelineSpec, trainer_stages
from streamrl.runtime.prerun import choose_pipeline, load_pipeline, resolve_run_length
from streamrl.runtime.rendezvous import RendezvousServer
from streamrl.runtime.run_metrics import RunMetrics
from streamrl.runtime.stage import StageError
from streamrl.runtime.status_page import StatusPage
from streamrl.runtime.supervision import RunFailed, Supervisor
from streamrl.runtime.worker import WorkerSpec
from streamrl.security import LAUNCHER, stage_role

__all__ = ["ResumeError", "RunFailed", "RunResult", "arun", "run", "truncate_metrics"]

log = logging.getLogger("streamrl.launcher")


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
    return event_loop.run(lambda: arun(config, overrides, **kwargs))


async def arun(config: str | Path | dict[str, Any] | RunConfig | None = None, overrides: list[str] | None = None,
               *, run_dir: str | Path | None = None, resume: str | Path | None = None,
               warm_start: bool = False) -> RunResult:
    """Validate the config and pipeline, launch everything, stream metrics, stop cleanly.

    ``resume=RUN_DIR`` continues that run from its newest complete checkpoint, in the same
    directory (``config`` defaults to the run's own config.yaml; ``overrides`` still apply).
    ``warm_start`` (what ``streamrl run`` does: a fresh process, where start-up is most of a short
    run): start the workers' forkserver first, before the config and the pipeline checks, so that
    its imports overlap theirs (``streamrl run`` starts it even before it imports this module); it
    is stopped again if they fail, or if the config launches no local processes. A process that
    calls ``run`` repeatedly keeps one forkserver from its first run on either way.
    """
    t_launch = time.monotonic()
    if warm_start:
        # the workers' forkserver imports torch, transformers and the stages (seconds of CPU) while
        # the launcher loads the config and checks the pipeline
        start_forkserver()
    try:
        if resume is not None:
            resume = Path(resume)
            if run_dir is not None and Path(run_dir).resolve() != resume.resolve():
                raise ResumeError(f"resume={str(resume)!r} continues in its own directory; "
                                  f"run_dir={str(run_dir)!r} differs: pass one of them")
            if config is None:
                config = resume / "config.yaml"
                if not config.is_file():
                    raise ResumeError(f"{resume} is not a run directory (no config.yaml); pass the directory a "
                                      "run printed as its run dir")
            run_dir = resume
        if config is None:
            raise ConfigError("no config: pass a config file (or resume=RUN_DIR to continue a run)")
        # the pipeline chosen for `auto` is the one config.yaml records, so a resumed run keeps it
        cfg = choose_pipeline(resolve_run_length(load_config(config, overrides)))
        if warm_start and cfg.resources.launch != "processes":
            stop_forkserver()  # no worker will fork from it
        pipeline = load_pipeline(cfg)
    except BaseException:
        if warm_start:
            stop_forkserver()  # a run that failed its checks leaves no process behind
        raise
    if cfg.resources.launch == "processes":
        start_forkserver()  # (warm_start: running already) its imports overlap the launcher's own start-up
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
    """One launch of a run: backend, supervision, metrics and status page, from start to result."""

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
        train_rows: list[dict[str, Any]] = []
        eval_rows: list[dict[str, Any]] = []
        resumed_at = resume.state.version if resume is not None else None
        if resumed_at is not None:
            # the rows up to the checkpoint stay; later ones were the dead run's and come again
            train_rows, eval_rows = truncate_metrics(run_dir / "metrics.jsonl", resumed_at)
            self.progress.message(f"streamrl: resuming {run_dir} from {Path(resume.path).name} "  # type: ignore[union-attr]
                                  f"(version {resumed_at})")
        self.metrics = RunMetrics(cfg, pipeline, run_dir, self.progress, train_rows, eval_rows, resumed_at)
        self.backend: LaunchBackend | None = None
        self.supervisor: Supervisor | None = None
        self.status: StatusPage | None = None
        self.dock_statistics: dict[str, Any] = {}
        self.warehouse_statistics: list[dict[str, Any]] = []
        self.t_end: float | None = None

    async def run(self) -> RunResult:
        cfg = self.cfg
        _remove_stale_ipc(self.run_dir)  # a killed run of this directory could not remove its own
        remove_dead_owners()  # nor could any killed launcher whose workers did not outlive it
        # ipc endpoints live in a short private dir (socket paths are limited to ~100 bytes)
        tmp = make_private_dir("/tmp")
        # shared-memory scratch (e.g. vLLM's weight files between processes), removed like tmp
        shm = make_private_dir(SHM_DIR) if Path(SHM_DIR).is_dir() else tmp
        backend = self.backend = BACKENDS[cfg.resources.launch](cfg, self.pipeline, self.run_dir, self.progress,
                                                                tmp, shm)
        sup = self.supervisor = Supervisor(cfg, self.pipeline, self.run_dir, self.t_launch, self.workers, backend,
                                           self.metrics, self.progress)
        dc = cfg.resources.dock
        limits = DockLimits(dc.max_message_mib, dc.max_header_mib, dc.max_clients, dc.max_parked)
        # each consumer's reads are fixed from the pipeline, so no claim (from any client) can set them
        views = {s.name: ConsumerView(list(s.reads), s.whole_groups) for s in self.pipeline.stages if s.reads}
        server: c.ControlServer | None = None
        rendezvous: RendezvousServer | None = None
        try:
            self.progress.message(f"streamrl: run dir {self.run_dir}")
            # abandoned on cancellation: a Ctrl-C or SIGTERM while joining a cluster ends the run at once
            # (backend.close() below ends the abandoned wait, so no thread holds the process)
            await anyio.to_thread.run_sync(backend.connect, abandon_on_cancel=True)
            dock = await anyio.to_thread.run_sync(backend.start_dock, views, limits)
            token = c.new_token()
            control, weights, rendezvous_host = await anyio.to_thread.run_sync(backend.endpoints)
            if rendezvous_host is not None:
                rendezvous = RendezvousServer(rendezvous_host, timeout_s=cfg.resources.start_timeout_s)
            backend.started()
            server_auth = backend.auth.server()
            server = c.ControlServer(control, token=token, workers={(w.stage, w.index) for w in self.workers},
                                     auth=server_auth)
            trainers = {s.name for s in trainer_stages(self.pipeline)}
            # colocated and disaggregated stages join torch.distributed through FileStores here
            (self.run_dir / "rendezvous").mkdir(exist_ok=True)
            async with anyio.create_task_group() as tg:
                if cfg.output.plot:
                    # The reward curve's matplotlib import (most of a second) now, rather than after the
                    # last step: until the forkserver has imported what the workers need, the launcher
                    # only waits for it (backend.start returns once the workers are forked).
                    tg.start_soon(functools.partial(anyio.to_thread.run_sync, import_plotting, abandon_on_cancel=True))
                if cfg.output.status_page:
                    await self._start_status_page(tg, dock.controller_endpoint)
                # each local process's event-loop core (resources.loop_affinity): after the dock's servers
                cores = loop_cores(cfg, self.pipeline)[1] if cfg.resources.launch == "processes" else []
                for g, group in enumerate(self.pipeline.process_groups()):
                    (host, k), rest = group[0], group[1:]
                    # each stage's own role, nothing more; a trainer's worker 0 serves the policy channel
                    auth = {s.name: backend.auth.client(stage_role(s.name)) for s, _ in group}
                    serves = any(s.name in trainers and i == 0 for s, i in group)
                    spec = WorkerSpec(config=cfg, stage=host, worker=k, colocated=[s for s, _ in rest],
                                      dock_endpoint=dock.controller_endpoint, control_endpoint=server.endpoint,
                                      weights_endpoint=weights, run_dir=str(self.run_dir), pipeline=self.pipeline,
                                      token=token, resume=self.resume, scratch_dir=tmp, shm_dir=shm,
                                      parent_pid=backend.parent_pid, auth=auth,
                                      server_auth=server_auth if serves else None,
                                      rendezvous_endpoint=rendezvous.endpoint if rendezvous is not None else "",
                                      loop_core=cores[g] if g < len(cores) else None)
                    members = [w for w in self.workers if (w.stage, w.index) in {(s.name, i) for s, i in group}]
                    await backend.start(members, spec, tg)
                # One task owns the socket's receive: a recv cancelled by the supervisor's poll timeout
                # could drop a message that had just arrived (e.g. the last Finished: the run would
                # then wait forever); a memory stream's receive loses nothing when cancelled.
                events_in, events = anyio.create_memory_object_stream[c.WorkerEvent | None](10_000)
                tg.start_soon(sup.pump_events, server, events_in)
                tg.start_soon(sup.watch_sigterm)
                sup.write_pids()
                await sup.supervise(server, events)
                self.t_end = time.monotonic()  # training ends here; shutdown is not training time
                self.dock_statistics, self.warehouse_statistics = await self._dock_statistics(
                    dock.controller_endpoint)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                async with anyio.create_task_group() as closing:
                    # the reward curve is drawn while the processes stop (a plot takes most of a second)
                    if cfg.output.plot and self.metrics.train_rows and sup.failure is None and sup.death is None:
                        closing.start_soon(functools.partial(
                            anyio.to_thread.run_sync, plot_reward_curve, list(self.metrics.train_rows),
                            self.run_dir / "reward_curve.png", cfg.output.name))
                    await self._stop_everything(sup, server, backend, rendezvous, tmp, shm)
        return self._result()

    async def _stop_everything(self, sup: Supervisor, server: c.ControlServer | None, backend: Any,
                               rendezvous: Any, tmp: Path, shm: Path) -> None:
        """Stop the workers, the status page, the control server and the dock; remove the run's
        scratch; close the progress line, the metrics and the trace."""
        if server is None:
            await anyio.to_thread.run_sync(sup.reap)
        else:
            stop = c.Stop(sup.stop_reason or "launcher stopping")
            await server.broadcast(stop)
            async with anyio.create_task_group() as reaping:
                reaping.start_soon(sup.stop_late_workers, server, stop)
                await anyio.to_thread.run_sync(sup.reap)
                reaping.cancel_scope.cancel()
        if self.status is not None:
            await self.status.close()
        if server is not None:
            server.close()
        await anyio.to_thread.run_sync(backend.close)  # the dock (ray: every actor, the placement group)
        if rendezvous is not None:
            rendezvous.close()
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(self.run_dir / "rendezvous", ignore_errors=True)
        self.progress.close()
        self.metrics.close()
        await anyio.to_thread.run_sync(finish_trace, self.run_dir, self.cfg.output.trace)  # trace.json

    async def _start_status_page(self, tg: anyio.abc.TaskGroup, dock_endpoint: str) -> None:
        """The live status page; the run goes on without it if it cannot be served."""
        assert self.supervisor is not None and self.backend is not None
        page = StatusPage(self.cfg, self.pipeline, self.run_dir, self.metrics, self.supervisor)
        try:
            url = await page.start()
        except OSError as exc:
            await page.close()
            log.warning("no status page: %s", exc)
            self.progress.message(f"streamrl: no status page ({exc}); the run goes on without it")
            return
        self.status = page
        self.progress.message(f"streamrl: status page {url}")
        tg.start_soon(page.board.poll_dock, dock_endpoint, self.backend.auth.client(LAUNCHER))

    async def _dock_statistics(self, endpoint: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The controller's and the warehouses' counters once training ended (what reached each
        stage, what each warehouse stored and served), for the result."""
        from streamrl.dock.client import DockClient

        try:
            with anyio.fail_after(3):
                async with DockClient(endpoint, client_id="launcher-stats", connect_timeout_s=2,
                                      request_timeout_s=2,
                                      auth=self.backend.auth.client(LAUNCHER) if self.backend else None) as dock:
                    stats = await dock.server_statistics()
            return dict(stats["controller"]), list(stats.get("warehouses", []))
        except Exception as exc:  # the dock died (that is reported on its own): no figures
            log.info("no dock statistics at the end: %s", exc)
            return {}, []

    def _result(self) -> RunResult:
        sup, m = self.supervisor, self.metrics
        assert sup is not None and self.backend is not None
        now = self.t_end or time.monotonic()
        logs = {f"{w.stage}-{w.index}": w.log_path for w in self.workers if w.log_path is not None}
        if sup.failure is not None:
            f = sup.failure
            tail = "\n".join(f.traceback.strip().splitlines()[-12:])
            error = StageError(f.stage, f.worker, f.indices, f"{f.message.split(': ', 1)[-1]}\n{tail}")
            if sup.death is None or not sup.crashed:
                raise error
            # a worker crashed and a peer failed on what it left (a collective's broken connection):
            # the crash is the cause, and a resumable one (resources.auto_resume)
            raise RunFailed(f"{sup.death}\nthen {error}", resumable=sup.resumable)
        if sup.death is not None:
            raise RunFailed(sup.death, resumable=sup.resumable)
        rows = m.train_rows
        ckpt = self.run_dir / "checkpoint"
        setup = (m.t_go or now) - self.t_launch
        self.progress.message(
            f"streamrl: {len(rows)} steps, final reward {rows[-1].get('reward_mean', float('nan')):.3f}, "
            f"setup {setup:.1f} s + training {now - (m.t_go or now):.1f} s ({sup.stop_reason}); "
            f"outputs in {self.run_dir}" if rows else f"streamrl: no step completed ({sup.stop_reason})"
        )
        return RunResult(
            run_dir=self.run_dir, metrics=rows, steps=len(rows), stop_reason=sup.stop_reason, setup_s=setup,
            train_s=now - (m.t_go or now), total_s=time.monotonic() - self.t_launch,
            time_to_target_s=m.time_to_target,
            checkpoint=ckpt if ckpt.is_dir() else None, worker_logs=logs, eval_metrics=m.eval_rows,
            resumed_from=self.resume.state.version if self.resume is not None else None,
            restarts=dict(m.restarts), dock_statistics=self.dock_statistics,
            warehouse_statistics=self.warehouse_statistics, placement=self.backend.placement(),
        )
