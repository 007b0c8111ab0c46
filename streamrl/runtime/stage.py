"""What a stage is: a small protocol, not a base class.

A *processing* stage (it has ``reads``)::

    class MyStage:
        async def setup(self, ctx: StageContext) -> None: ...       # build models, open files
        async def process(self, batch: Batch) -> Output | dict: ...  # one micro-batch -> new columns
        async def close(self) -> None: ...

The runtime loops claim -> fetch -> process -> put -> ack for each worker. ``process`` returns
one value per sample for each column in the stage's ``writes`` (a dict, or an :class:`Output`
that also sets the samples' policy versions and lengths). Heavy compute belongs in
``await ctx.run_sync(fn, ...)`` (a worker thread): the event loop must stay free to renew
leases and serve weights.

A *source* stage (no ``reads``) has ``async def produce(self) -> Output | None`` instead: each
call returns the columns of new samples (``Output.group_size`` consecutive samples form a group),
None when it has no more. Optional ``async def wait_ready(self)``: what it waits for before the next
``produce`` (e.g. a policy version), awaited by the runtime apart, so waiting is not counted as
the stage's busy time. A processing stage's optional ``async def wait_ready_for(self, batch)``
is the same for a claimed batch, before its ``process`` (the generate stage: the batch's policy
version installed); raising :class:`GiveBack` there gives the batch back to the dock.

A *side* stage (no ``reads``, no ``writes``: e.g. evaluation) has ``async def run(self) -> None``
instead: it works beside the dataflow until it returns or the run stops (Stop cancels it).

Optional: a class attribute ``max_workers = N`` (the pipeline check refuses more workers),
and ``def claim_size(self) -> ClaimSize`` to change how many samples the next claim asks
for and the oldest policy version it accepts (the trainer uses it to fill exactly one step).
``self.claims_one_reserve = True`` (set in ``setup``) makes each claim take samples of one
source ``produce`` only (the dock's ``one_reserve``): a generator does so when its source may
put a step's prompts before their policy version is out (:mod:`streamrl.stages.source`).
Raise :class:`StopRun` from ``process`` to end the whole run successfully (e.g. target reached).

A worker that computes together with another one instead of claiming (a tensor-parallel rank
other than 0: its rank 0 claims and tells it what to compute) sets ``self.follows = True`` in
``setup``; the runtime then awaits ``stage.follow()`` in place of the claim loop (Stop cancels it).
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

import anyio.to_thread

from streamrl import loop_affinity
from streamrl.dock.client import SampleList
from streamrl.dock.protocol import SampleInfo
from streamrl.security import ClientAuth, ServerAuth

if TYPE_CHECKING:
    from streamrl.config import RunConfig
    from streamrl.engines.core_share import CoreShare
    from streamrl.runtime.checkpoints import ResumeFrom
    from streamrl.runtime.control import ControlClient
    from streamrl.runtime.pipeline import PipelineSpec, StageSpec
    from streamrl.runtime.policy import PolicySubscriber

T = TypeVar("T")

# How long a trainer waits for the launcher to record a step's row before its checkpoint commit
# fails. The launcher writes a row in milliseconds, so this only ends a wait on a stuck launcher;
# one that is gone stops its workers sooner (their parent watch).
RECORD_TIMEOUT_S = 120.0

# StageContext.run_brief runs a call on the event loop while its previous call took less than
# this: the loop blocked for under a millisecond delays nothing it serves (lease heartbeats come
# every lease_ttl_s / 4; a weights request waits for a step anyway), while a hop to the compute
# thread and back took 0.4 ms each way in a W1 step's trace (docs/benchmarks.md §38).
BRIEF_CALL_S = 1e-3


class GiveBack(Exception):
    """Raised by a stage's ``wait_ready_for``: the runtime gives the batch back to the dock (no
    failure) and claims again. A generator whose batch's policy version has not come within a
    lease TTL does so: the version may need older samples that a worker which died held, back in
    the dock by now and ahead of this batch in the queue."""


class StopRun(Exception):
    """Raised by a stage to end the run successfully (e.g. the target reward was reached)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class StageError(RuntimeError):
    """A stage failed; names the stage, the worker and the samples it was processing."""

    def __init__(self, stage: str, worker: int, indices: Sequence[int], message: str) -> None:
        shown = list(indices)[:16]
        more = f" (+{len(indices) - 16} more)" if len(indices) > 16 else ""
        super().__init__(f"stage {stage!r} worker {worker} failed on samples {shown}{more}: {message}")
        self.stage = stage
        self.worker = worker
        self.indices = list(indices)


@dataclass
class Output:
    columns: dict[str, list[Any]]
    versions: list[int] | None = None  # policy version that produced each sample
    lengths: list[int] | None = None  # tokens per sample (for length-balanced claims)
    group_size: int = 1  # sources only: consecutive samples that form a group
    # processing stages only: True drops that sample from the run (no later stage gets it; the
    # dock's discard, docs/dock-protocol.md §5.6); its values in ``columns`` are not stored
    discard: list[bool] | None = None


def as_output(result: Any, writes: Sequence[str], n: int) -> Output:
    """What a processing stage's ``process`` returned for a batch of ``n``, as an :class:`Output`;
    ValueError unless it has exactly the columns in ``writes`` and one value (discard flag, version,
    length) per sample."""
    out = result if isinstance(result, Output) else Output(columns=dict(result or {}))
    missing = [c for c in writes if c not in out.columns]
    extra = [c for c in out.columns if c not in writes]
    if missing or extra:
        raise ValueError(f"process() must return exactly the columns in writes={list(writes)}; "
                         f"missing {missing}, not declared {extra}")
    for name, values in out.columns.items():
        if len(values) != n:
            raise ValueError(f"column {name!r} has {len(values)} values for a batch of {n}")
    for name, values, unit in (("discard", out.discard, "flags"), ("versions", out.versions, "versions"),
                               ("lengths", out.lengths, "lengths")):
        if values is not None and len(values) != n:
            raise ValueError(f"Output.{name} has {len(values)} {unit} for a batch of {n}")
    return out


@dataclass
class ClaimSize:
    n: int
    min_n: int = 1
    min_version: int | None = None


@dataclass
class Batch(SampleList):
    """One claimed micro-batch: sample metadata (``indices``, ``groups``, ``versions``,
    ``lengths``) plus the columns the stage reads."""

    samples: list[SampleInfo]
    columns: dict[str, list[Any]]


@dataclass
class StageContext:
    config: RunConfig
    spec: StageSpec
    worker: int
    run_dir: Path
    device: str
    policy: PolicySubscriber
    control: ControlClient
    weights_endpoint: str
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("streamrl.stage"))
    # one dict per worker process, shared by the stages colocated in it (pipeline `colocate_with`)
    shared: dict[str, Any] = field(default_factory=dict)
    # the pipeline this worker runs in (e.g. a disaggregated generate stage reads its train stage's workers)
    pipeline: PipelineSpec | None = None
    # a resumed run: the checkpoint it continues from (streamrl.runtime.checkpoints); None = a fresh run
    resume: ResumeFrom | None = None
    # the run's private scratch directories (disk; shared memory where the machine has it), removed
    # by the launcher when the run ends even if this worker is killed; None: not in a launched run
    scratch_dir: Path | None = None
    shm_dir: Path | None = None
    # this stage's role credentials (every socket it opens to the run's servers presents them), and
    # what verifies the run's roles where this worker serves a socket itself (the trainer's worker 0
    # serves the policy channel); None: not in a launched run (streamrl.security)
    auth: ClientAuth | None = None
    server_auth: ServerAuth | None = None
    # a run across hosts: the launcher's torch.distributed store, HOST:PORT ("" = a FileStore in run_dir)
    rendezvous_endpoint: str = ""
    # the dock controller's statistics (DockClient.controller_statistics: one round trip, or a long
    # poll of watched consumers' figures; its counters, e.g. samples_discarded), set once the
    # worker's dock client is open: a source reads it to generate as much as consumers drop
    dock_statistics: Callable[..., Awaitable[dict[str, Any]]] | None = None
    # this worker process's share of the host's cores (resources.core_share, CPU stages of a launched
    # run): run_sync marks its thread computing, the engines rebalance its torch threads; None: off
    cores: CoreShare | None = None
    # run_brief's record: the last call's own seconds, per function
    brief_calls: dict[Callable[..., Any], float] = field(default_factory=dict)

    @property
    def options(self) -> dict[str, Any]:
        return self.spec.options

    async def run_sync(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run blocking compute in a worker thread so leases and weight serving keep going; with a
        core share, the thread counts as computing on this host meanwhile."""
        call = functools.partial(fn, *args, **kwargs)
        cores = self.cores

        def computing() -> T:
            # every core for this thread, which the event loop's pinned thread may have started
            loop_affinity.release_this_thread()
            if cores is None:
                return call()
            with cores.computing():
                return call()

        return await anyio.to_thread.run_sync(computing)

    async def run_brief(self, fn: Callable[..., T], *args: Any, local: bool = True) -> T:
        """``fn(*args)``, local compute that is often brief (a small model's weights install or
        optimizer step): here, on the event loop, while its previous call took under
        :data:`BRIEF_CALL_S`; in the compute thread (:meth:`run_sync`) otherwise, and the first time.
        ``local=False``: this call waits on something outside the process (a collective over
        several ranks, an engine's RPC), so it always goes to the compute thread.

        Why: a hop to the compute thread and back costs about as much as such a call (two thread
        wake-ups, on a host whose cores every process of the run shares), and in a synchronous step
        each one is on the step's path. Only for calls that wait on nothing else (no collective, no
        other process): the event loop waits with the call. ``fn`` is the key of the record (a bound
        method is equal to itself from call to call; a new closure is not)."""
        record = self.brief_calls

        def timed() -> T:  # where it runs: the hop to the thread is not the call's time
            started = time.perf_counter()
            try:
                return fn(*args)
            finally:
                record[fn] = time.perf_counter() - started

        if local and record.get(fn, math.inf) < BRIEF_CALL_S:
            return timed()
        return await self.run_sync(timed)

    def report_metrics(self, metrics: dict[str, float], *, defer: bool = False) -> None:
        """This stage's own figures (e.g. reward-server latency); they join every later step's
        row in metrics.jsonl as ``<stage>/<name>`` (``<stage>/<worker>/<name>`` with several workers).
        Figures reported during a batch ride its busy report; ``defer`` makes figures reported
        between batches wait for the next report too (one message fewer: for figures of work done
        just before a batch, as a generator's weights install)."""
        self.control.stage_metrics(metrics, defer=defer)

    def report_step(self, step: int, metrics: dict[str, float], *, record: bool = False,
                    ended_at: float = 0.0) -> None:
        """Send one optimizer step's metrics to the launcher (metrics.jsonl, TensorBoard, progress).
        ``record``: the launcher answers once the row is on disk (:meth:`wait_recorded`).
        ``ended_at``: the ``time.time()`` the step ended (0: now); the row takes the stages' figures
        measured before it, so a trainer gives the moment before its new version became visible."""
        self.control.step(step, metrics, record=record, ended_at=ended_at)

    async def wait_recorded(self, step: int, timeout_s: float = RECORD_TIMEOUT_S) -> bool:
        """Until the launcher has the row of ``step`` (reported with ``record``) in metrics.jsonl:
        a trainer commits the checkpoint of a step only then. False: the run stopped before the
        launcher recorded it (commit nothing)."""
        try:
            return await self.control.wait_recorded(step, timeout_s)
        except TimeoutError:
            raise RuntimeError(f"the launcher did not record step {step} within {timeout_s:g} s; its checkpoint "
                               "is not committed") from None

    def report_eval(self, step: int, metrics: dict[str, float]) -> None:
        """Send the evaluation of policy version ``step``: a row of its own in metrics.jsonl, the
        names prefixed ``eval/``."""
        self.control.eval_report(step, metrics)


@runtime_checkable
class Stage(Protocol):
    async def setup(self, ctx: StageContext) -> None: ...

    async def process(self, batch: Batch) -> Output | dict[str, list[Any]]: ...

    async def close(self) -> None: ...


@runtime_checkable
class Side(Protocol):
    async def setup(self, ctx: StageContext) -> None: ...

    async def run(self) -> None: ...

    async def close(self) -> None: ...


@runtime_checkable
class Source(Protocol):
    async def setup(self, ctx: StageContext) -> None: ...

    async def produce(self) -> Output | None: ...

    async def close(self) -> None: ...
