"""One stage worker: set up the stage, wait for Go, then loop claim -> fetch -> process -> put (with the ack).

Runs as its own process (``python -m streamrl.runtime.worker SPEC.json``, the default) or as a
task inside the launcher's process (``resources.launch: inprocess``). A process can host several
stages' worker k (``colocate_with`` in the pipeline, ``WorkerSpec.colocated``): each runs its own
loop as a task of one event loop, with its own dock and control clients, and they share
``ctx.shared`` (a dict, one per process), e.g. the colocated policy of the train and generate stages.

On failure the leased samples are released back to the dock (another worker, or a rerun, gets
them), the launcher gets a ``Failed`` event naming the stage, worker and samples, and the
process exits non-zero.
"""

from __future__ import annotations

import asyncio
import builtins
import faulthandler
import functools
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import torch
import zmq.asyncio

from streamrl import event_loop, loop_affinity
from streamrl.config import RunConfig
from streamrl.dock.client import DockClient, Lease
from streamrl.dock.errors import DockError, EndOfStream, RemoteError
from streamrl.metrics.trace import Tracer, open_tracer, reset_tracer, tracer, use_tracer
from streamrl.models.device import DeviceUnavailableError, resolve_device
from streamrl.runtime.checkpoints import ResumeFrom
from streamrl.runtime.control import ControlClient
from streamrl.runtime.host_memory import keep_freed_memory
from streamrl.runtime.orphans import remove_if_owner_is, wait_gone
from streamrl.runtime.pipeline import PipelineSpec, StageSpec, import_object
from streamrl.runtime.policy import PolicySubscriber
from streamrl.runtime.stage import Batch, GiveBack, Output, StageContext, StageError, StopRun, as_output
from streamrl.security import ClientAuth, ServerAuth

if TYPE_CHECKING:
    from streamrl.engines.core_share import CoreShare

log = logging.getLogger("streamrl.worker")

BUSY_REPORT_S = 0.5  # how often a worker tells the launcher its busy time
# A batch is reported as running only once it has run this long: a small model's batches mostly end
# sooner, and their end report alone tells the launcher when they ran (one message per batch, not
# two; the busy reports were most of the launcher's events, docs/benchmarks.md §27)
BEGIN_REPORT_S = 0.02
STOP_ACK_TIMEOUT_S = 10.0  # the ack of a stage's last batch, before its StopRun ends the run


class WorkerSpec(msgspec.Struct, kw_only=True):
    config: RunConfig
    stage: StageSpec
    worker: int
    dock_endpoint: str
    control_endpoint: str
    weights_endpoint: str
    run_dir: str
    parent_pid: int = 0  # the launcher: exit once it is gone (no orphans if it is killed)
    colocated: list[StageSpec] = msgspec.field(default_factory=list)  # more stages' worker k in this process
    pipeline: PipelineSpec | None = None  # the whole graph, for stages that pair with another stage
    token: str = ""  # the run's control-channel token (runtime/control.py); the spec file is 0600
    resume: ResumeFrom | None = None  # a resumed run: the checkpoint it continues from
    # the run's private directories on disk and in shared memory (/dev/shm where there is one): the
    # launcher removes them when the run ends, also after a killed worker that could not clean up
    scratch_dir: str = ""
    shm_dir: str = ""
    # the credentials of each stage this process hosts, by stage name: its role `stage:<name>` and
    # nothing more (streamrl.security); the run's servers admit no socket without them. A process
    # that hosts a trainer's worker 0 also serves the policy channel: server_auth verifies the roles
    auth: dict[str, ClientAuth] = msgspec.field(default_factory=dict)
    server_auth: ServerAuth | None = None
    # a run across hosts (resources.launch: ray): the dock warehouse on this worker's node (new
    # samples are written there), and the launcher's torch.distributed store, HOST:PORT
    # (streamrl.runtime.rendezvous) instead of a FileStore
    home_warehouse: int | None = None
    rendezvous_endpoint: str = ""
    # the core of this process's event loop and ZeroMQ I/O threads from Go on (streamrl.loop_affinity);
    # None: the kernel places them
    loop_core: int | None = None


class _Meter:
    """A worker's busy time: the seconds inside ``process()`` / ``produce()``. It tells the launcher
    its total when a batch has run ``BEGIN_REPORT_S`` (or sooner, just before a step row the batch
    sends: the trainer's), when it ends, and every ``BUSY_REPORT_S``
    (the in-flight batch included, with the moment it measured), from which the launcher derives
    ``busy/<stage>`` for each step (:mod:`streamrl.metrics.busy`). Each batch is also a span of
    the worker's trace. ``begin`` and ``end`` run on the worker's event loop."""

    def __init__(self, control: ControlClient, stage: str = "") -> None:
        self.control = control
        self.stage = stage
        control.before_step = self._report_before_row
        self.busy_s = 0.0  # finished batches
        self.batches = 0
        self.samples = 0
        self._started: float | None = None  # the batch in flight, if any
        self._running_report: asyncio.TimerHandle | None = None  # its report once it ran BEGIN_REPORT_S

    def begin(self) -> None:
        self._started = time.perf_counter()
        self.control.hold_figures = True  # the batch's figures ride its busy reports
        self._cancel_running_report()
        self._running_report = asyncio.get_running_loop().call_later(BEGIN_REPORT_S, self._report_running)

    def _cancel_running_report(self) -> bool:
        """Drop the running batch's pending report; True if one was pending."""
        if self._running_report is None:
            return False
        self._running_report.cancel()
        self._running_report = None
        return True

    def _report_running(self) -> None:
        # (a failing produce() leaves its batch unended: the worker may have closed the channel since)
        self._running_report = None
        if self._started is not None and not self.control.closed:
            self.flush()

    def _report_before_row(self) -> None:
        # ControlClient.step's hook: a step row sent from inside a batch (the trainer's) must not reach
        # the launcher before that batch's first report, or the row misses the batch
        if self._cancel_running_report():
            self.flush()

    def end(self, samples: int, name: str = "process", **args: Any) -> None:
        self._cancel_running_report()  # this end report says it all
        if self._started is not None:
            ended = time.perf_counter()
            self.busy_s += ended - self._started
            tracer().complete(name, "batch", self._started, ended, "batch", stage=self.stage, samples=samples,
                              **{k: v for k, v in args.items() if v != ""})
            self._started = None
        self.control.hold_figures = False
        self.batches += 1
        self.samples += samples
        self.flush()

    def flush(self) -> None:
        # The busy total and the running batch's seconds from one clock reading: the launcher takes
        # their difference as the finished batches' seconds, and one that shrinks as a restarted
        # worker's (counting its whole history again). Two readings differed by however long this
        # thread waited between them (for the GIL, while the compute thread runs): a later report
        # with a shorter wait looked like a restart, and a step's row counted the worker busy all
        # through it.
        now = time.perf_counter()
        # a running batch reports a positive in_batch_s even at its first instant
        in_batch = max(now - self._started, 1e-9) if self._started is not None else 0.0
        self.control.busy(self.busy_s + in_batch, self.batches, self.samples, in_batch, time.time())

    async def report_every(self, interval_s: float) -> None:
        """Tell the launcher the busy time so far, in flight included, until cancelled. Sent even
        when idle: it is also the heartbeat by which the launcher tells a blocked worker."""
        while True:
            self.flush()
            await anyio.sleep(interval_s)


def _versions(versions: list[int] | None) -> str:
    """A batch's policy versions for its trace span: "3", or "2..3" when they differ."""
    if not versions:
        return ""
    lo, hi = min(versions), max(versions)
    return str(lo) if lo == hi else f"{lo}..{hi}"


async def run_worker(spec: WorkerSpec) -> int:
    """Run one worker process to completion: its stage's worker and those colocated with it.

    Returns the process exit code (0 ok, 1 if any of its stages failed)."""
    shared: dict[str, Any] = {}
    cores = _core_share(spec)
    if not spec.colocated:
        return await _run_stage_worker(spec, spec.stage, shared, cores)
    codes: list[int] = []

    async def one(sspec: StageSpec) -> None:
        codes.append(await _run_stage_worker(spec, sspec, shared, cores))

    async with anyio.create_task_group() as tg:
        for sspec in [spec.stage, *spec.colocated]:
            tg.start_soon(one, sspec)
    return max(codes, default=0)


def _core_share(spec: WorkerSpec) -> CoreShare | None:
    """This process's part in the host's core share: where resources.core_share is on, the run has
    a shared-memory scratch directory on this host, and a stage of the process computes on the CPU."""
    stages = [spec.stage, *spec.colocated]
    if not (spec.config.resources.core_share and spec.shm_dir
            and any(_on_cpu(s.device or spec.config.resources.device) for s in stages)):
        return None
    from streamrl.engines.core_share import CoreShare  # the engines package: in the workers only

    share = CoreShare(Path(spec.shm_dir) / "cores", max(s.threads for s in stages))
    log.info("core share: up to %d torch threads while computing alone, an equal share of the host's %d cores "
             "while other stages compute too", share.threads, share.cores)
    return share


def _on_cpu(device: str) -> bool:
    """Whether a stage's device setting means the CPU (a bad setting is the stage's own error to raise)."""
    try:
        return resolve_device(device).type == "cpu"
    except DeviceUnavailableError:
        return False


async def _run_stage_worker(spec: WorkerSpec, sspec: StageSpec, shared: dict[str, Any],
                            cores: CoreShare | None = None) -> int:
    cfg = spec.config
    auth = spec.auth.get(sspec.name)  # this stage's role only, even where colocated stages share the process
    control = ControlClient(spec.control_endpoint, sspec.name, spec.worker, token=spec.token, auth=auth)
    policy = PolicySubscriber(spec.weights_endpoint, auth=auth, shm_dir=Path(spec.shm_dir) if spec.shm_dir else None)
    device = sspec.device or cfg.resources.device
    indices: list[int] = []
    stage: Any = None
    trace = _open_trace(spec, sspec)
    trace_token = use_tracer(trace)  # this stage worker's tasks record into its own file
    try:
        cls = import_object(sspec.cls, "stage class")
        stage = cls()
        async with anyio.create_task_group() as tg:
            ctx = StageContext(cfg, sspec, spec.worker, Path(spec.run_dir), device, policy, control,
                               spec.weights_endpoint, logging.getLogger(f"streamrl.stage.{sspec.name}"),
                               shared=shared, pipeline=spec.pipeline, resume=spec.resume,
                               scratch_dir=Path(spec.scratch_dir) if spec.scratch_dir else None,
                               shm_dir=Path(spec.shm_dir) if spec.shm_dir else None,
                               auth=auth, server_auth=spec.server_auth,
                               rendezvous_endpoint=spec.rendezvous_endpoint, cores=cores)
            ctx.tasks = tg  # type: ignore[attr-defined]  # for stages that serve in the background
            if spec.parent_pid:  # from the start: a launcher killed during set-up leaves no orphan
                tg.start_soon(_watch_parent, spec, control, tg)
            with trace.span("setup", "batch", "setup"):
                set_up = await _setup_unless_stopped(stage, ctx, control, sspec, spec.worker)
            if not set_up:
                tg.cancel_scope.cancel()
                await stage.close()
                return 0
            control.ready()
            if not await control.wait_go(cfg.resources.start_timeout_s + 60):
                tg.cancel_scope.cancel()
                return 0
            if spec.loop_core is not None:
                # from Go on: the threads set-up started (compute, OpenMP, gloo) keep every core
                loop_affinity.pin_loop_threads(spec.loop_core)

            # Stop cancels the loop only, not the dock client: its reply reader must keep running
            # so that the shielded release of a lease held at that moment gets its answer.
            loop_scope = anyio.CancelScope()

            async def stop_watch() -> None:
                reason = await control.wait_stop()
                log.info("%s[%d]: stop received (%s)", sspec.name, spec.worker, reason)
                loop_scope.cancel()

            tg.start_soon(stop_watch)
            meter = _Meter(control, sspec.name)
            tg.start_soon(meter.report_every, BUSY_REPORT_S)
            async with DockClient(spec.dock_endpoint, client_id=f"{sspec.name}-{spec.worker}-{os.getpid()}",
                                  lease_ttl_s=cfg.resources.dock.lease_ttl_s,
                                  max_message_mib=cfg.resources.dock.max_message_mib,
                                  auth=auth, home_warehouse=spec.home_warehouse) as dock:
                ctx.dock_statistics = dock.controller_statistics
                with loop_scope:
                    try:
                        if sspec.is_source:
                            await _source_loop(stage, dock, meter)
                        elif sspec.is_side:
                            await stage.run()  # beside the dataflow: no claims, no puts
                        elif getattr(stage, "follows", False):
                            await stage.follow()  # computes what its leader claims: no claims of its own
                        else:
                            await _stage_loop(stage, sspec, dock, meter, indices)
                    except StopRun as stop:
                        control.stop_request(stop.reason)
                meter.flush()
                log.info("%s[%d]: stage loop ended", sspec.name, spec.worker)
                if control.stop_reason is not None:
                    # the run ends: a claim the Stop cut short is not waited for (the controller holds
                    # it until its timeout, and no other worker wants what it could still be granted)
                    dock.abandoned_claims_wait_s = 0.0
            log.info("%s[%d]: dock client closed", sspec.name, spec.worker)
            tg.cancel_scope.cancel()
        await stage.close()
        control.finished()
        log.info("%s[%d]: finished", sspec.name, spec.worker)
        return 0
    except Exception as exc:
        exc = _root_cause(exc)
        err = StageError(sspec.name, spec.worker, indices, f"{type(exc).__name__}: {exc}")
        log.error("%s", err)
        control.failed(indices, str(err), traceback.format_exc())
        if stage is not None:
            try:
                await stage.close()
            except Exception:
                log.exception("close() of stage %r failed after an error", sspec.name)
        return 1
    finally:
        policy.close()
        control.close()
        reset_tracer(trace_token)
        trace.close()


def _open_trace(spec: WorkerSpec, sspec: StageSpec) -> Tracer:
    """This stage worker's trace file (``output.trace``), or a tracer that records nothing."""
    if not spec.config.output.trace:
        return Tracer()
    stages = [s.name for s in spec.pipeline.stages] if spec.pipeline is not None else None
    try:
        return open_tracer(Path(spec.run_dir), sspec.name, spec.worker, workers=sspec.workers, stages=stages)
    except OSError as exc:  # a diagnostic: the run goes on without it
        log.warning("%s[%d]: no trace (%s)", sspec.name, spec.worker, exc)
        return Tracer()


async def _setup_unless_stopped(stage: Any, ctx: StageContext, control: ControlClient, sspec: StageSpec,
                                worker: int) -> bool:
    """Run ``stage.setup``; False if the launcher said Stop meanwhile (e.g. another stage failed).

    Why: a set-up can wait a long time on other workers (joining a torch.distributed world waits
    for every rank); when one of them has failed, waiting out the timeout would only delay the
    run's end.
    """
    async with anyio.create_task_group() as tg:
        async def watch() -> None:
            reason = await control.wait_stop()
            log.info("%s[%d]: stop received during set-up (%s)", sspec.name, worker, reason)
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        await stage.setup(ctx)
        tg.cancel_scope.cancel()
    return control.stop_reason is None


_EXCEPTION_GROUPS: tuple[type, ...] = tuple(
    t for t in (getattr(builtins, "BaseExceptionGroup", None),) if t is not None
) or (anyio.get_cancelled_exc_class(),)  # Python 3.10 has no exception groups in builtins


def _root_cause(exc: BaseException) -> BaseException:
    """The stage's own exception, not the task groups' ExceptionGroup around it."""
    while isinstance(exc, _EXCEPTION_GROUPS) and exc.exceptions:
        real = [e for e in exc.exceptions if not isinstance(e, anyio.get_cancelled_exc_class())]
        exc = (real or list(exc.exceptions))[0]
    return exc


# After the launcher is gone, how long a worker may take to stop before it exits hard (at most;
# resources.exit_grace_s when that is shorter). Nothing an orphan does is of use (its trainer can
# commit no checkpoint without the launcher recording the step), so this only lets a thread in the
# middle of a step or a write end cleanly.
ORPHAN_EXIT_S = 10.0


def _exit_orphan(parent_pid: int, grace_s: float) -> None:
    log.error("launcher %d is gone and this worker did not stop within %.0f s (a blocking call, e.g. a "
              "collective waiting for a peer that is gone); exiting", parent_pid, grace_s)
    logging.shutdown()
    os._exit(1)


async def _watch_parent(spec: WorkerSpec, control: ControlClient, tg: anyio.abc.TaskGroup) -> None:
    """Workers are forked from a forkserver, not the launcher, so watch the launcher's pid itself
    (a pidfd: this wakes the moment it exits).

    Once it is gone the worker removes the launcher's private directories (the launcher cannot,
    killed; only those it owned: :mod:`streamrl.runtime.orphans`) and cancels its stages (a trainer
    waiting, shielded, for the launcher to record its step gives up: ``control.abandon``).
    Cancelling stops the event loop's work, but not a blocking call in a worker thread (a
    collective or a stage's own ``run_sync``), which can hold the process for as long as its own
    timeout (600 s for collectives): with nobody left to stop it, the worker exits hard once
    ``ORPHAN_EXIT_S`` (or ``resources.exit_grace_s``, if shorter) has passed."""
    parent_pid = spec.parent_pid
    await wait_gone(parent_pid)
    log.error("launcher %d is gone: stopping", parent_pid)
    grace_s = min(ORPHAN_EXIT_S, spec.config.resources.exit_grace_s)
    timer = threading.Timer(grace_s, _exit_orphan, args=(parent_pid, grace_s))
    timer.daemon = True
    timer.start()
    endpoints = [spec.dock_endpoint, spec.control_endpoint, spec.weights_endpoint]
    sockets = [os.path.dirname(e[len("ipc://"):]) for e in endpoints if e.startswith("ipc://")]
    removed = remove_if_owner_is([spec.scratch_dir, spec.shm_dir, *sockets], parent_pid)
    if removed:
        log.info("removed the launcher's directories %s", removed)
    control.abandon()
    tg.cancel_scope.cancel()


async def _source_loop(stage: Any, dock: DockClient, meter: _Meter) -> None:
    while True:
        wait_ready = getattr(stage, "wait_ready", None)
        if wait_ready is not None:  # waiting (e.g. for a policy version) is not work: outside the meter
            await wait_ready()
        meter.begin()
        out = await stage.produce()
        if out is None:
            meter.end(0, "produce")
        else:
            meter.end(len(next(iter(out.columns.values()))), "produce", version=_versions(out.versions))
        if out is None:
            await dock.close_input()
            return
        # add() waits while the dock is full: the source runs only as far ahead as consumers allow
        await dock.add(out.columns, group_size=out.group_size, versions=out.versions, lengths=out.lengths)


async def _stage_loop(stage: Any, spec: StageSpec, dock: DockClient, meter: _Meter, indices: list[int]) -> None:
    claim_size = getattr(stage, "claim_size", None)
    if claim_size is None:
        await _prefetching_loop(stage, spec, dock, meter, indices)
        return
    # the stage sizes each claim from its state after the previous batch: no prefetch
    while True:
        size = claim_size()
        try:
            lease = await dock.claim(spec.name, spec.reads, size.n, min_n=size.min_n,
                                     whole_groups=spec.whole_groups, balance_by_length=spec.balance_by_length,
                                     min_version=size.min_version)
        except EndOfStream:
            return
        indices[:] = lease.indices
        await _guarded(stage, spec, dock, lease, None, meter)
        indices.clear()


async def _prefetching_loop(stage: Any, spec: StageSpec, dock: DockClient, meter: _Meter,
                            indices: list[int]) -> None:
    """Claim and fetch micro-batch i+1 while micro-batch i is processed (hides one round trip
    per hop when the pipeline streams). At most one lease waits; if the loop stops, the waiting
    lease is released so another worker gets its samples.

    A stage with ``wait_ready_for`` (a generator waiting for its batch's policy version) claims
    the next batch only once the batch in hand has what it waits for: a worker whose batch waits
    for a version never holds older samples that version needs (given back by a worker that died),
    which another worker can then take."""
    send, receive = anyio.create_memory_object_stream[tuple[Lease, dict[str, list[Any]], anyio.Event | None]](0)
    # a stage may take one producer's reserve at a time (a generator when its source runs ahead:
    # streamrl.stages.source)
    one_reserve = bool(getattr(stage, "claims_one_reserve", False))
    gated = getattr(stage, "wait_ready_for", None) is not None
    # a stage that writes nothing and says so may go on to its next batch while the controller
    # applies its ack (the train stage with options.rollout, whose next batch is the next step)
    ack_later: Callable[[Lease], None] | None = None

    async def fetcher() -> None:
        ready: anyio.Event | None = None  # set once the batch handed over last has what it waits for
        async with send:
            while True:
                if ready is not None:
                    await ready.wait()
                try:
                    lease = await dock.claim(spec.name, spec.reads, spec.micro_batch,
                                             whole_groups=spec.whole_groups,
                                             balance_by_length=spec.balance_by_length, one_reserve=one_reserve)
                except EndOfStream:
                    return
                handed = False
                try:
                    columns = await dock.fetch(lease.indices, spec.reads)
                    ready = anyio.Event() if gated else None  # set by the processing side for this batch
                    await send.send((lease, columns, ready))
                    handed = True
                finally:
                    if not handed:
                        await _release_quietly(dock, lease)

    stop: StopRun | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(fetcher)
        if getattr(stage, "acks_in_background", False) and not spec.writes:
            # in the loop's task group: its failure fails the loop, as an awaited ack's would
            ack_later = functools.partial(tg.start_soon, _ack_shielded, dock)
        async with receive:
            async for lease, columns, ready in receive:
                indices[:] = lease.indices
                try:
                    await _guarded(stage, spec, dock, lease, columns, meter,
                                   ready=ready.set if ready is not None else None, ack_later=ack_later)
                except StopRun as exc:
                    # the run ends here (a trainer that claims this way: options.rollout); raised
                    # past the task group, not wrapped in its exception group, once the fetcher
                    # has given back the lease it holds
                    stop = exc
                    tg.cancel_scope.cancel()
                    break
                finally:
                    if ready is not None:  # also when the batch failed or went back: the fetcher goes on
                        ready.set()
                indices.clear()
    if stop is not None:
        raise stop


async def _ack_shielded(dock: DockClient, lease: Lease) -> None:
    """A batch's ack in the background: shielded (a StopRun's cancellation of the loop waits for it,
    so every sample trained is acked) and bounded."""
    with anyio.CancelScope(shield=True), anyio.fail_after(STOP_ACK_TIMEOUT_S):
        await dock.ack(lease)


async def _guarded(stage: Any, spec: StageSpec, dock: DockClient, lease: Lease,
                   columns: dict[str, list[Any]] | None, meter: _Meter,
                   ready: Callable[[], None] | None = None, ack_later: Callable[[Lease], None] | None = None) -> None:
    try:
        await _process_lease(stage, spec, dock, lease, columns, meter, ready, ack_later)
    except StopRun:
        raise  # the lease was acked: the stage consumed its samples
    except BaseException:
        await _release_quietly(dock, lease)  # nothing lost: the samples go back to the pool
        raise


async def _release_quietly(dock: DockClient, lease: Lease) -> None:
    """Give a lease back on the way out (shielded, at most 5 s). The dock may not know it any more
    (e.g. a Stop cancelled the ack after the controller had taken it): that is not a new error."""
    with anyio.CancelScope(shield=True), anyio.move_on_after(5):
        try:
            await dock.release(lease)
        except DockError as exc:
            log.warning("could not release lease %d on the way out: %s", lease.lease_id, exc)


async def _process_lease(stage: Any, spec: StageSpec, dock: DockClient, lease: Lease,
                         columns: dict[str, list[Any]] | None, meter: _Meter,
                         ready: Callable[[], None] | None = None,
                         ack_later: Callable[[Lease], None] | None = None) -> None:
    """``ready``: called once the batch has what ``wait_ready_for`` waits for. ``ack_later``: sends
    the ack of a batch that wrote nothing without waiting for it (a stage with ``acks_in_background``)."""
    if columns is None:
        columns = await dock.fetch(lease.indices, spec.reads)
    batch = Batch(lease.samples, columns)
    wait_ready = getattr(stage, "wait_ready_for", None)
    if wait_ready is not None:  # waiting (e.g. for the batch's policy version) is not work: outside the meter
        try:
            await wait_ready(batch)
        except GiveBack as exc:
            log.info("%s: giving samples %s back to the dock: %s", spec.name, lease.indices[:8], exc)
            await _release_quietly(dock, lease)
            return
    if ready is not None:
        ready()
    meter.begin()
    result: Any = None
    try:
        result = await stage.process(batch)
    except StopRun:
        # the stage consumed these before deciding to stop. Shielded: every trainer rank raises StopRun
        # at the same step, and the Stop that the first one's request brings must not cancel another
        # rank's ack (its lease would be released, and samples it trained counted as never done)
        with anyio.CancelScope(shield=True), anyio.fail_after(STOP_ACK_TIMEOUT_S):
            await dock.ack(lease)
        raise
    finally:
        out_versions = getattr(result, "versions", None) if isinstance(result, Output) else None
        meter.end(len(lease), version=_versions(lease.versions), **({"out_version": _versions(out_versions)}
                                                                    if out_versions else {}))
    out = as_output(result, spec.writes, len(lease))
    indices = lease.indices
    if out.discard is not None and any(out.discard):
        # dropped from the run first: no later stage waits for them (the dock's discard)
        keep = [k for k, drop in enumerate(out.discard) if not drop]
        await dock.ack(lease, [i for i, drop in zip(indices, out.discard, strict=True) if drop], discard=True)
        indices = [indices[k] for k in keep]
        out = Output({name: [values[k] for k in keep] for name, values in out.columns.items()},
                     versions=[out.versions[k] for k in keep] if out.versions is not None else None,
                     lengths=[out.lengths[k] for k in keep] if out.lengths is not None else None)
    if out.columns and indices:
        try:
            # the put carries the lease's ack: the controller applies it with the columns' readiness
            await dock.put(indices, out.columns, versions=out.versions, lengths=out.lengths, ack=lease)
            return
        except RemoteError as exc:
            if "already written" not in exc.message:
                raise
            # A worker of this stage held these samples before, wrote their columns and lost its
            # lease (it stalled past the lease TTL, or died with its put's readiness in flight); the
            # samples came here. Their columns are written (write-once): this batch's result is
            # dropped and the samples acked, so each reaches the next stage once.
            log.warning("%s: samples %s were already written by a worker whose lease expired; acking them",
                        spec.name, lease.indices[:8])
    if indices:  # else every sample was discarded: that ack was the lease's last
        if ack_later is not None and indices == lease.indices:
            ack_later(lease)
            return
        await dock.ack(lease)


def pin_event_loop_thread(threads: int) -> None:
    """The calling (event loop) thread computes on one torch thread; threads started later on
    ``threads`` (the compute calls of ``StageContext.run_sync``, which the core share then
    rebalances).

    Why: libgomp counts the threads of every OpenMP team in the process, and once they outnumber
    the cores it stops spinning between parallel regions, so every one of them pays a sleep and a
    wake-up. A team of the event loop (its message copies, a weights snapshot) beside the compute
    thread's team is enough on a 2-core host: the compute thread's small kernels ran at about half
    speed (a fused AdamW step 2.0 against 0.9 ms, a W2 trainer's optimizer step 40 against 15 ms).
    torch keeps a thread's count once its first parallel region has set it, and gives a new thread
    the process-wide count of the last ``set_num_threads``: so this thread takes 1 and runs one
    region at once, and the process-wide count is then set to ``threads`` from a helper thread,
    which leaves this thread's alone.
    """
    torch.set_num_threads(1)
    torch.zeros(1 << 16)  # a parallel region (above torch's grain of 32768 elements): fixes this thread at 1
    helper = threading.Thread(target=torch.set_num_threads, args=(threads,), name="streamrl-torch-threads")
    helper.start()
    helper.join()


def quiet_progress_bars() -> None:
    """No Hugging Face progress bars in this worker: its output is a log file, where a bar (a
    checkpoint export's "Writing model shards") is a line of carriage-return debris. Unless the
    user's environment asks for them (``HF_HUB_DISABLE_PROGRESS_BARS=0``)."""
    if os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1") != "1":
        return
    transformers = sys.modules.get("transformers")  # imported already (the forkserver's preload): it read
    if transformers is not None:  # the variable then; one imported later reads it itself
        transformers.utils.logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m streamrl.runtime.worker SPEC.json", file=sys.stderr)
        return 2
    spec = msgspec.json.decode(Path(args[0]).read_bytes(), type=WorkerSpec)
    logging.basicConfig(level=os.environ.get("STREAMRL_LOG", "INFO"),  # the worker's own log file
                        format=f"%(asctime)s {spec.stage.name}[{spec.worker}] %(name)s: %(message)s")
    quiet_progress_bars()
    keep_freed_memory()  # before the worker starts its threads: they share its one arena
    pin_event_loop_thread(max(s.threads for s in [spec.stage, *spec.colocated]))
    # `kill -USR1 <pid>` (the launcher does it for a stalled run) writes every thread's Python
    # stack to this worker's log: works while a thread blocks in C or the event loop is stuck
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    # a crash in native code (SIGSEGV, SIGABRT...) leaves every thread's Python stack in the log too
    faulthandler.enable(file=sys.stderr, all_threads=True)
    code = event_loop.run(run_worker, spec)
    # The process ends with os._exit (multiprocessing), which kills zmq's I/O thread at once: the
    # last Finished/Failed could still sit in its queue and never reach the launcher, which then
    # waits for it. Closing the context flushes what is queued (sockets linger at most 2 s).
    zmq.asyncio.Context.instance().destroy(linger=2000)
    return code


def write_spec(spec: WorkerSpec, path: Path) -> None:
    """Write the spec readable by its owner only: it holds the run's control token and the
    process's role credentials."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # a spec left by an earlier launch of this run dir keeps its mode otherwise
    with os.fdopen(fd, "wb") as f:
        f.write(msgspec.json.encode(spec))


if __name__ == "__main__":
    sys.exit(main())
