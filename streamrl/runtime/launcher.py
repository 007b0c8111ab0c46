"""Launch a run: dock + one worker per stage replica, metrics, progress, clean shutdown.

``processes`` (default): controller, warehouses and every stage worker are separate local
processes started here, each in its own session so a Ctrl-C reaches only the launcher, which
then stops them in order (Stop, wait, SIGTERM, SIGKILL). Every child also exits by itself if
the launcher disappears. ``inprocess``: the stage workers are tasks of this process and the
dock servers threads, for stepping through with a debugger.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import msgspec

from streamrl.config import RunConfig, dump_config, load_config
from streamrl.dock.controller import ConsumerView
from streamrl.dock.launch import LocalDock, ThreadDock
from streamrl.dock.limits import DockLimits
from streamrl.metrics.progress import Progress
from streamrl.metrics.writer import MetricsWriter, plot_reward_curve
from streamrl.runtime import control as c
from streamrl.runtime.pipeline import PipelineSpec, load_pipeline, resolve_run_length
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
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
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


STOP_GRACE_S = 15.0  # after a stop request, how long workers get to close (checkpoint) before SIGTERM


class RunFailed(RuntimeError):
    """The run stopped because a stage failed or a worker died; the message says which and where."""


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

    @property
    def final_reward(self) -> float | None:
        return self.metrics[-1].get("reward_mean") if self.metrics else None


@dataclass
class _Worker:
    stage: str
    index: int
    log_path: Path | None = None
    proc: multiprocessing.process.BaseProcess | None = None


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


def run(config: str | Path | dict[str, Any] | RunConfig, overrides: list[str] | None = None,
        **kwargs: Any) -> RunResult:
    """Run a config to completion (blocking). See :func:`arun`."""
    return anyio.run(lambda: arun(config, overrides, **kwargs))


async def arun(config: str | Path | dict[str, Any] | RunConfig, overrides: list[str] | None = None, *,
               run_dir: str | Path | None = None) -> RunResult:
    """Validate the config and pipeline, launch everything, stream metrics, stop cleanly."""
    t_launch = time.monotonic()
    cfg = resolve_run_length(load_config(config, overrides))
    pipeline = load_pipeline(cfg)
    rdir = Path(run_dir) if run_dir is not None else _new_run_dir(cfg)
    rdir.mkdir(parents=True, exist_ok=True)
    (rdir / "config.yaml").write_text(dump_config(cfg))
    (rdir / "pipeline.yaml").write_text(Path(pipeline.path).read_text())
    return await _Launch(cfg, pipeline, rdir, t_launch).run()


class _Launch:
    def __init__(self, cfg: RunConfig, pipeline: PipelineSpec, run_dir: Path, t_launch: float) -> None:
        self.cfg = cfg
        self.pipeline = pipeline
        self.run_dir = run_dir
        self.t_launch = t_launch
        self.workers = [_Worker(s.name, k) for s in pipeline.stages for k in range(s.workers)]
        self.progress = Progress(cfg.algo.steps, cfg.output.progress)
        self.metrics = MetricsWriter(run_dir, tensorboard=cfg.output.tensorboard, wandb=cfg.output.wandb,
                                     run_config=msgspec.to_builtins(cfg))
        self.busy: dict[tuple[str, int], float] = {}
        self.stage_metrics: dict[tuple[str, int], dict[str, float]] = {}
        self.train_rows: list[dict[str, Any]] = []
        self.eval_rows: list[dict[str, Any]] = []
        self.busy_at_last_step: dict[str, float] = {}
        self.t_last_step = 0.0
        self.t_go = 0.0
        self.time_to_target: float | None = None
        self.failure: c.Failed | None = None
        self.death: str | None = None
        self.stop_reason = ""
        self.t_end: float | None = None
        self.dock: LocalDock | ThreadDock | None = None

    async def run(self) -> RunResult:
        cfg = self.cfg
        # ipc endpoints live in a short private dir (socket paths are limited to ~100 bytes)
        tmp = tempfile.mkdtemp(prefix="srl-", dir="/tmp")
        dock: LocalDock | ThreadDock
        dc = cfg.resources.dock
        limits = DockLimits(dc.max_message_mib, dc.max_header_mib, dc.max_clients, dc.max_parked)
        # each consumer's reads are fixed from the pipeline, so no claim (from any client) can set them
        views = {s.name: ConsumerView(list(s.reads), s.whole_groups) for s in self.pipeline.stages if s.reads}
        if cfg.resources.launch == "processes":
            dock = LocalDock(self.pipeline.consumers, cfg.dock_capacity, dc.warehouses, dc.transport,
                             start_timeout_s=cfg.resources.start_timeout_s, limits=limits, views=views)
        else:
            dock = ThreadDock(self.pipeline.consumers, cfg.dock_capacity, dc.warehouses, limits=limits, views=views)
        self.dock = dock
        server: c.ControlServer | None = None
        try:
            self.progress.message(f"streamrl: run dir {self.run_dir}")
            dock.start()
            token = c.new_token()
            server = c.ControlServer(f"ipc://{tmp}/control", token=token,
                                     workers={(w.stage, w.index) for w in self.workers})
            weights = f"ipc://{tmp}/weights"
            # colocated and disaggregated stages join torch.distributed through FileStores here
            (self.run_dir / "rendezvous").mkdir(exist_ok=True)
            async with anyio.create_task_group() as tg:
                for group in self.pipeline.process_groups():
                    (host, k), rest = group[0], group[1:]
                    spec = WorkerSpec(config=cfg, stage=host, worker=k, colocated=[s for s, _ in rest],
                                      dock_endpoint=dock.controller_endpoint, control_endpoint=server.endpoint,
                                      weights_endpoint=weights, run_dir=str(self.run_dir), pipeline=self.pipeline,
                                      token=token,
                                      parent_pid=os.getpid() if cfg.resources.launch == "processes" else 0)
                    members = [w for w in self.workers if (w.stage, w.index) in {(s.name, i) for s, i in group}]
                    if cfg.resources.launch == "processes":
                        self._spawn(members, spec)
                    else:
                        tg.start_soon(run_worker, spec)
                # One task owns the socket's receive: a recv cancelled by the supervisor's poll timeout
                # could drop a message that had just arrived (e.g. the last Finished: the run would
                # then wait forever); a memory stream's receive loses nothing when cancelled.
                events_in, events = anyio.create_memory_object_stream[c.WorkerEvent | None](10_000)
                tg.start_soon(self._pump_events, server, events_in)
                await self._supervise(server, events)
                self.t_end = time.monotonic()  # training ends here; shutdown is not training time
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
                dock.stop()
                shutil.rmtree(tmp, ignore_errors=True)
                shutil.rmtree(self.run_dir / "rendezvous", ignore_errors=True)
                self.progress.close()
                self.metrics.close()
        return self._result()

    def _spawn(self, members: list[_Worker], spec: WorkerSpec) -> None:
        """One process for ``members`` (a stage's worker and the workers colocated with it)."""
        logs = self.run_dir / "logs"
        logs.mkdir(exist_ok=True)
        name = "+".join(f"{w.stage}-{w.index}" for w in members)
        spec_path = logs / f"{name}.spec.json"
        write_spec(spec, spec_path)
        log_path = logs / f"{name}.log"
        proc = _mp.Process(target=_worker_process, args=(str(spec_path), str(log_path)),
                           name=f"streamrl-{name}", daemon=False)
        for w in members:
            w.log_path, w.proc = log_path, proc
        with _main_module_hidden():
            proc.start()

    def _check_processes(self) -> None:
        if isinstance(self.dock, LocalDock) and not self.dock.alive() and self.death is None:
            self.death = "a dock server process died (controller or warehouse); the run cannot continue"
        for w in self.workers:
            if w.proc is not None and w.proc.exitcode not in (None, 0) and self.death is None:
                code = w.proc.exitcode
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                self.death = f"stage {w.stage!r} worker {w.index} {how}; its log: {w.log_path}"

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
        ready: set[tuple[str, int]] = set()
        finished: set[tuple[str, int]] = set()
        deadline = time.monotonic() + self.cfg.resources.start_timeout_s
        stop_deadline: float | None = None
        went = False
        while True:
            event = None
            with anyio.move_on_after(0.2):
                event = await events.receive()
            self._check_processes()
            match event:
                case c.Ready(stage=s, worker=k):
                    ready.add((s, k))
                case c.StageBusy(stage=s, worker=k, busy_s=b):
                    self.busy[(s, k)] = b
                case c.StageMetrics(stage=s, worker=k, metrics=m):
                    self.stage_metrics[(s, k)] = m
                case c.StepReport(step=step, metrics=m):
                    self._on_step(step, m)
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
            if not went and ready == expected:
                went = True
                self.t_go = self.t_last_step = time.monotonic()
                self.progress.message(f"streamrl: {len(expected)} workers ready in "
                                      f"{self.t_go - self.t_launch:.1f} s; training")
                await server.broadcast(c.Go())
            if not went and time.monotonic() > deadline:
                missing = sorted(expected - ready)
                raise RunFailed(f"workers {missing} did not finish setup within resources.start_timeout_s="
                                f"{self.cfg.resources.start_timeout_s} s; see {self.run_dir / 'logs'}")
            for w in self.workers:  # a clean exit counts as finished even if its message was lost
                if w.proc is not None and w.proc.exitcode == 0:
                    finished.add((w.stage, w.index))
            if finished == expected:
                self.stop_reason = self.stop_reason or "all stages finished"
                return
            if stop_deadline is not None and time.monotonic() > stop_deadline:
                late = sorted(expected - finished)
                log.warning("workers %s did not finish within %.0f s of Stop; stopping them", late, STOP_GRACE_S)
                self.progress.message(f"streamrl: workers {late} did not finish within {STOP_GRACE_S:.0f} s of "
                                      "Stop; stopping them (see their logs)")
                return  # stragglers are reaped below

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

    def _on_step(self, step: int, metrics: dict[str, float]) -> None:
        now = time.monotonic()
        row: dict[str, Any] = {"step": step, **metrics, "elapsed_s": round(now - self.t_go, 4)}
        wall = max(now - self.t_last_step, 1e-9)
        for s in self.pipeline.stages:
            total = sum(b for (name, _), b in self.busy.items() if name == s.name)
            row[f"busy/{s.name}"] = round((total - self.busy_at_last_step.get(s.name, 0.0)) / wall / s.workers, 4)
            self.busy_at_last_step[s.name] = total
        for (stage, k), values in sorted(self.stage_metrics.items()):
            for name, v in values.items():
                key = f"{stage}/{name}" if self.pipeline.stage(stage).workers == 1 else f"{stage}/{k}/{name}"
                row[key] = v
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
                if sig is not None and p.pid is not None:
                    try:
                        os.kill(p.pid, sig)
                    except ProcessLookupError:
                        pass
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
            raise RunFailed(self.death)
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
        )
