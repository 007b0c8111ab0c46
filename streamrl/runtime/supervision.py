"""Supervision of a launch: the start barrier, the workers' events, process checks and
restarts, stall detection with stack dumps, SIGTERM, and stopping every process at the end.

:class:`Supervisor` reads the control channel's events until the run ends (all stages
finished, a stop request, a failure, a dead process, a stall, SIGTERM) and records why in
``stop_reason``, ``failure`` (a stage's own ``Failed``) or ``death`` (the run's machinery broke;
``resumable``). The figures it receives go to :class:`~streamrl.runtime.run_metrics.RunMetrics`;
what went wrong also goes to ``errors`` (bounded), which the live status page shows.
"""

from __future__ import annotations

import collections
import json
import logging
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from streamrl.config import RunConfig
from streamrl.metrics.progress import Progress
from streamrl.runtime import control as c
from streamrl.runtime import startup_gc
from streamrl.runtime.checkpoints import latest_checkpoint
from streamrl.runtime.launch_backends import LaunchBackend, _Worker, send_signal
from streamrl.runtime.pipeline import PipelineSpec
from streamrl.runtime.ray_cluster import RemoteProcess
from streamrl.runtime.run_metrics import RunMetrics

log = logging.getLogger("streamrl.launcher")

STOP_GRACE_S = 15.0  # after a stop request, how long workers get to close (checkpoint) before SIGTERM
SILENT_WORKER_S = 5.0  # a worker that sent no heartbeat for this long has a blocked event loop
STACK_DUMP_WAIT_S = 1.0  # after SIGUSR1, how long a worker gets to write its stacks to its log
# After a stage's error, how long to look for a worker that crashed first: when one rank of a
# collective dies, its peers fail on the broken connection ("Connection reset by peer"), and the
# error that reaches the launcher first is often the peer's, not the crash that caused it.
CRASH_LOOK_S = 0.5
PROCESS_POLL_S = 0.05  # how often, at most, the supervisor polls the processes while events arrive
CRASH_REPORT_LINES = 60  # of a crashed worker's log, from faulthandler's "Fatal Python error" on
MAX_ERRORS = 50  # the newest errors and warnings kept for the status page
ERROR_CHARS = 4000  # of each


class RunFailed(RuntimeError):
    """The run stopped because a stage failed or a worker died; the message says which and where.

    ``resumable``: the failure was the run's machinery (a trainer or dock process died, a stall),
    not a stage's error, so resuming from the last checkpoint may get past it
    (``resources.auto_resume`` does that)."""

    def __init__(self, message: str, *, resumable: bool = False) -> None:
        super().__init__(message)
        self.resumable = resumable


class Supervisor:
    """One launch's supervision: :meth:`supervise` runs until the run ends and leaves why in
    ``stop_reason`` / ``failure`` / ``death``; the launcher then stops everything through it."""

    def __init__(self, cfg: RunConfig, pipeline: PipelineSpec, run_dir: Path, t_launch: float,
                 workers: list[_Worker], backend: LaunchBackend, metrics: RunMetrics, progress: Progress) -> None:
        self.cfg = cfg
        self.pipeline = pipeline
        self.run_dir = run_dir
        self.t_launch = t_launch
        self.workers = workers
        self.backend = backend
        self.metrics = metrics
        self.progress = progress
        self.restarts = metrics.restarts  # process name -> times restarted (also in each step's row)
        self.term_requested = False
        self.finished: set[tuple[str, int]] = set()
        self.ready: set[tuple[str, int]] = set()
        self.failure: c.Failed | None = None
        self.death: str | None = None
        # the death was a crash (a signal, an unexpected exit code, a lost node), not the exit of a
        # stage that raised and reported it (code 1): it outranks a stage's error in the run's report
        self.crashed = False
        self.resumable = False
        self.stop_reason = ""
        self.stopping = False  # a stop request or SIGTERM arrived: the run is winding down
        # the newest failures, restarts and warnings: {"time": unix seconds, "kind": ..., "text": ...}
        self.errors: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_ERRORS)

    def note(self, kind: str, text: str) -> None:
        """An error or warning for the status page (the run's logs have the whole story)."""
        self.errors.append({"time": time.time(), "kind": kind, "text": text[:ERROR_CHARS]})

    async def supervise(self, server: c.ControlServer,
                        events: anyio.abc.ObjectReceiveStream[c.WorkerEvent | None]) -> None:
        expected = {(w.stage, w.index) for w in self.workers}
        by_key = {(w.stage, w.index): w for w in self.workers}
        ready = self.ready
        finished = self.finished
        deadline = time.monotonic() + self.cfg.resources.start_timeout_s
        stop_deadline: float | None = None
        term_deadline: float | None = None
        went = False
        next_poll = 0.0
        while True:
            event = None
            with anyio.move_on_after(0.2):
                event = await events.receive()
            # The processes are polled at most every PROCESS_POLL_S, not at every event: a small
            # model's run sends hundreds of events a second (each worker's busy reports), and polling
            # every process for each was a fifth of the launcher's CPU (docs/benchmarks.md §26).
            now = time.monotonic()
            poll = event is None or isinstance(event, c.Failed | c.Finished) or now >= next_poll
            if poll:
                next_poll = now + PROCESS_POLL_S
                self._check_processes(stopping=stop_deadline is not None or term_deadline is not None)
                for w in self.workers:  # a clean exit counts as finished even if its message was lost
                    if w.proc is not None and w.proc.exitcode == 0:
                        finished.add((w.stage, w.index))
            match event:
                case c.Ready(stage=s, worker=k):
                    ready.add((s, k))
                    if went:  # a restarted worker: the run is under way
                        await server.send_to((s, k), c.Go())
                case c.StageBusy(stage=s, worker=k, busy_s=b, samples=n, in_batch_s=in_batch, measured_at=at,
                                 metrics=m):
                    if m:  # figures the batch reported (as a StageMetrics would, below)
                        self.metrics.stage_figures.report(s, k, m, at)
                    self.metrics.busy[(s, k)] = b
                    self.metrics.busy_tracker.report(s, k, b, in_batch, at)
                    self.metrics.samples[(s, k)] = n
                    w = by_key[(s, k)]
                    w.heartbeat, w.in_batch_s = time.monotonic(), in_batch
                case c.StageMetrics(stage=s, worker=k, metrics=m, measured_at=at):
                    # merged: a stage reports different figures at different times (engine start-up once,
                    # each weight install later), and each stays in the rows until it reports it again;
                    # a row takes those measured before its step ended (streamrl.metrics.stage_figures)
                    self.metrics.stage_figures.report(s, k, m, at)
                case c.StepReport(step=step, metrics=m, measured_at=at, record=record):
                    self.metrics.on_step(step, m, at, durable=record)
                    if record:  # the row is on disk: the trainer may commit this step's checkpoint
                        await server.broadcast(c.Recorded(step))
                case c.EvalReport(step=step, metrics=m):
                    self.metrics.on_eval(step, m)
                case c.Failed():
                    self.failure = event
                    self.note("failure", f"stage {event.stage!r} worker {event.worker}: {event.message}")
                case c.StopRequest(reason=reason):
                    self.stop_reason = reason
                    self.stopping = True
                    await server.broadcast(c.Stop(reason))
                    stop_deadline = time.monotonic() + self._stop_grace_s()
                case c.Finished(stage=s, worker=k):
                    finished.add((s, k))
            if self.death is not None and self.failure is None:
                await self._drain_for_failure(events)
            elif self.failure is not None and self.death is None:
                await self._look_for_a_crash()
            if self.failure is not None or self.death is not None:
                return
            if self.term_requested and term_deadline is None and stop_deadline is None:
                term_deadline = time.monotonic() + self._term_grace_s()
                self.stopping = True
                self.progress.message("streamrl: SIGTERM: saving a checkpoint after the current step, then stopping "
                                      "(SIGTERM again, or Ctrl-C, stops at once)")
                await server.broadcast(c.Save("SIGTERM"))
            if term_deadline is not None and stop_deadline is None and time.monotonic() > term_deadline:
                self.stop_reason = "SIGTERM (no step ended in time to save a checkpoint)"
                self.progress.message(f"streamrl: no step ended within {self._term_grace_s():.0f} s of SIGTERM; "
                                      f"stopping without a new checkpoint ({self.resume_hint()})")
                self.note("warning", f"no step ended within {self._term_grace_s():.0f} s of SIGTERM")
                return
            if not went and ready == expected:
                went = True
                self.metrics.go()
                startup_gc.resume()  # the launcher's start-up is over (streamrl.cli paused the collector)
                self.progress.message(f"streamrl: {len(expected)} workers ready in "
                                      f"{self.metrics.t_go - self.t_launch:.1f} s; training")
                await server.broadcast(c.Go())
            if went and stop_deadline is None and self._stalled():
                await self._report_stall()
                return
            if not went and time.monotonic() > deadline:
                missing = sorted(expected - ready)
                raise RunFailed(f"workers {missing} did not finish setup within resources.start_timeout_s="
                                f"{self.cfg.resources.start_timeout_s} s; see {self.run_dir / 'logs'}")
            if finished == expected and not server.pending(events):  # their last events read first
                self.stop_reason = self.stop_reason or "all stages finished"
                return
            if stop_deadline is not None and time.monotonic() > stop_deadline:
                late = sorted(expected - finished)
                log.warning("workers %s did not finish within %.0f s of Stop; stopping them", late, STOP_GRACE_S)
                self.progress.message(f"streamrl: workers {late} did not finish within {STOP_GRACE_S:.0f} s of "
                                      "Stop; stopping them (see their logs)")
                self.note("warning", f"workers {late} did not finish within {STOP_GRACE_S:.0f} s of Stop")
                return  # stragglers are reaped below

    def _term_grace_s(self) -> float:
        """After SIGTERM, how long the current step (and its save) may take: a step is checked
        against the stall timeout anyway."""
        return self.cfg.resources.stall_timeout_s or 600.0

    async def watch_sigterm(self) -> None:
        """SIGTERM with checkpoints on: save after the current step, then stop (a second one, or
        none of that configured: stop at once, as Ctrl-C does). Only the main thread gets signals."""
        if threading.current_thread() is not threading.main_thread():
            return
        with anyio.open_signal_receiver(signal.SIGTERM) as signals:
            async for _ in signals:
                if self.term_requested or not self.cfg.output.checkpoint_every or not self.metrics.t_go:
                    signal.raise_signal(signal.SIGINT)  # the event loop turns it into a clean cancellation
                    return
                self.term_requested = True

    def _stalled(self) -> bool:
        limit = self.cfg.resources.stall_timeout_s
        if not limit:
            return False
        first = self.metrics.t_progress == self.metrics.t_go  # no step yet in this launch (fresh or resumed)
        return time.monotonic() - self.metrics.t_progress > (2 * limit if first else limit)

    async def _report_stall(self) -> None:
        """No step for stall_timeout_s: name the workers that look stuck, with their Python stacks."""
        now = time.monotonic()
        idle_s = now - self.metrics.t_progress
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
                      + f"\n{self.resume_hint()}")
        self.resumable = True
        self.note("stall", self.death)
        log.error("%s", self.death)

    def _dump_stacks(self, workers: list[_Worker]) -> dict[int, str]:
        """SIGUSR1 to each worker's process (faulthandler writes its threads' stacks to its log),
        then the new text of each log."""
        sizes = {}
        for w in workers:
            if w.proc is not None and w.proc.pid is not None and w.log_path is not None and w.proc.is_alive():
                sizes[id(w)] = w.log_path.stat().st_size if w.log_path.exists() else 0
                send_signal(w.proc, signal.SIGUSR1)
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

    def reap(self) -> None:
        """Wait for workers to exit after Stop (resources.exit_grace_s); SIGTERM, then SIGKILL, whoever
        lingers."""
        procs = list({id(w.proc): w.proc for w in self.workers if w.proc is not None}.values())
        grace = self.cfg.resources.exit_grace_s
        for sig, wait in ((None, grace), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            alive = [p for p in procs if p.is_alive()]
            if not alive:
                break
            for p in alive:
                if sig is not None:
                    send_signal(p, sig)
            deadline = time.monotonic() + wait
            for p in alive:
                p.join(timeout=max(0.05, deadline - time.monotonic()))
        for p in procs:
            if not p.is_alive():
                p.close()

    def write_pids(self) -> None:
        """``logs/pids.json``: every process of the run (for operators: ``kill -USR1`` dumps a
        worker's stacks into its log; and for fault-injection tests)."""
        logs = self.run_dir / "logs"
        logs.mkdir(exist_ok=True)
        tmp = logs / "pids.json.tmp"
        tmp.write_text(json.dumps(self.backend.pids(), indent=1))
        tmp.replace(logs / "pids.json")

    def resume_hint(self) -> str:
        if not self.cfg.output.checkpoint_every:
            return "this run saved no checkpoint (output.checkpoint_every: 0), so it cannot be resumed"
        found = latest_checkpoint(self.run_dir)
        where = f"its newest checkpoint is {found.name}" if found else "it has no complete checkpoint yet"
        return f"resume it with: streamrl run --resume {self.run_dir} ({where})"

    def _check_processes(self, stopping: bool) -> None:
        which = self.backend.dock_dead()
        if which is not None and self.death is None:
            self.death = (f"a dock server process died ({which}); the run cannot continue; " + self.resume_hint())
            self.resumable = self.crashed = True
            self.note("death", self.death)
        for name, (members, spec) in list(self.backend.processes.items()):
            proc = members[0].proc
            if proc is None or proc.exitcode in (None, 0) or self.death is not None:
                continue
            code = proc.exitcode
            lost = getattr(proc, "lost", None)  # a Ray host actor (or its whole node) died
            how = _how_it_ended(proc)
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
                self.note("restart", f"{name} {how}; restarted ({self.restarts[name]} of "
                                     f"{self.cfg.resources.max_restarts})")
                proc.close()
                self.backend.spawn(members, spec)
                self.write_pids()
                continue
            w = members[0]
            # a process that died (not a stage that raised: that arrives as Failed) is the run's
            # machinery failing: resuming from the last checkpoint may get past it
            self.resumable = True
            self.crashed = code != 1 or bool(lost)
            extra = ""
            if code != 1 and w.restartable and not stopping:
                extra = f" (restarted {self.restarts.get(name, 0)} times already: resources.max_restarts)"
            self._record_death(w, how + extra)

    def _record_death(self, w: _Worker, how: str) -> None:
        self.death = f"stage {w.stage!r} worker {w.index} {how}; its log: {w.log_path}; {self.resume_hint()}"
        if self.crashed and w.log_path is not None:
            self.death += crash_report(Path(w.log_path))
        self.note("death", self.death)

    async def _look_for_a_crash(self) -> None:
        """A stage reported an error: was it the echo of another worker's crash? Within
        ``CRASH_LOOK_S``, a worker that died by a signal or an unexpected exit code becomes the
        run's death (the launcher reports it first, and a resumable run resumes)."""
        assert self.failure is not None
        failed = (self.failure.stage, self.failure.worker)
        # workers in processes (an in-process run's stages share the launcher's: nothing to look for)
        peers = [w for w in self.workers if (w.stage, w.index) != failed and w.proc is not None]
        deadline = time.monotonic() + CRASH_LOOK_S
        while peers:
            for w in peers:
                assert w.proc is not None
                code, lost = w.proc.exitcode, getattr(w.proc, "lost", None)
                if code not in (None, 0, 1) or lost:
                    self.resumable = self.crashed = True
                    self._record_death(w, _how_it_ended(w.proc))
                    return
            if time.monotonic() > deadline:
                return
            await anyio.sleep(0.05)

    @staticmethod
    async def stop_late_workers(server: c.ControlServer, stop: c.Stop) -> None:
        """While reaping: a worker that connects only now (it was still starting when the run
        ended, so the broadcast missed it) gets Stop too, instead of waiting out the reap's grace."""
        while True:
            event = await server.recv()
            if isinstance(event, c.Starting | c.Ready):
                await server.broadcast(stop)

    @staticmethod
    async def pump_events(server: c.ControlServer,
                          events: anyio.abc.ObjectSendStream[c.WorkerEvent | None]) -> None:
        async with events:
            while True:
                await events.send(await server.recv())


def _how_it_ended(proc: Any) -> str:
    """'was killed by signal 11', 'exited with code 3', 'was lost: ...' (+ the Ray node)."""
    code, lost = proc.exitcode, getattr(proc, "lost", None)
    how = f"was lost: {lost}" if lost else f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    if isinstance(proc, RemoteProcess):
        how += f" (on {proc.node.describe()})"
    return how


def crash_report(log_path: Path, max_lines: int = CRASH_REPORT_LINES, max_bytes: int = 64 * 1024) -> str:
    """The end of a crashed worker's log for the run's error: from faulthandler's last "Fatal Python
    error" (every thread's Python stack at the crash) on, else its last lines; "" when unreadable
    (a log on another node)."""
    try:
        with log_path.open("rb") as f:
            f.seek(max(0, f.seek(0, 2) - max_bytes))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    lines = text.splitlines()
    start = max((i for i, line in enumerate(lines) if line.startswith("Fatal Python error")), default=None)
    # (faulthandler's last line, the extension modules loaded, is one line of a few thousand characters)
    shown = [line for line in (lines[start:] if start is not None else lines[-10:])
             if not line.startswith("Extension modules:")][:max_lines]
    if not shown:
        return ""
    return "; its log ends with:\n" + "\n".join(shown)
