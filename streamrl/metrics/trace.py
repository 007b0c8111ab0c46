"""The run's timeline: spans of every worker as Chrome trace events, merged into ``RUN_DIR/trace.json``.

Each stage worker writes ``RUN_DIR/trace/<stage>-<worker>.json`` as it goes: one Trace Event
Format event per line (the JSON array format: ``[`` on the first line, then ``{...},`` lines),
written straight to the file, so a killed worker leaves every event it recorded before it died.
A file stops growing at :data:`MAX_FILE_BYTES` (a last instant event says so). A restarted worker
appends to its predecessor's file.

:func:`merge_trace` (the launcher at the end of a run; ``streamrl trace RUN_DIR`` for a running,
finished or crashed one) reads every worker file, skips a line cut short by a crash, and writes
``trace.json``: ``{"traceEvents": [...], "displayTimeUnit": "ms"}``, which ui.perfetto.dev and
chrome://tracing open.

Events: ``"X"`` complete events (``ts`` and ``dur`` in whole microseconds; ``ts`` since the Unix
epoch: each writer maps ``time.perf_counter`` onto ``time.time_ns`` once, when it opens its file,
so spans of different processes, also on different hosts with synchronised clocks, line up),
``"C"`` counters (the policy version a worker holds) and ``"M"`` metadata naming the tracks.
``pid`` is the stage (1 + its index in the pipeline), ``tid`` a lane of one worker:
``10 * worker + lane`` with the lanes of :data:`LANES`, so spans that overlap in time (a
prefetching claim while the batch before it runs) sit on different tracks.

Instrumented code asks :func:`tracer` for the current worker's tracer (a context variable: each
stage worker of a process has its own); outside a traced worker it gets a tracer that records
nothing, at the cost of one context-variable lookup.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

log = logging.getLogger("streamrl.metrics.trace")

TRACE_DIR = "trace"  # the workers' files, in the run directory
TRACE_FILE = "trace.json"  # the merged trace
MAX_FILE_BYTES = 32 << 20  # one worker's file; past it the worker records nothing more
CAP_EVENT = "trace file cap reached"  # the last event of a file that reached MAX_FILE_BYTES

# lane -> (offset in the worker's tid, track name)
LANES: dict[str, tuple[int, str]] = {
    "batch": (0, "batches"),  # process()/produce(); the trainer's optimizer steps inside them
    "dock_in": (1, "dock claim/fetch"),  # claims (waiting for samples) and fetches
    "dock_out": (2, "dock reserve/put/ack"),  # reserves (waiting for capacity), puts, acks, releases
    "policy": (3, "policy versions"),  # waiting for a version, fetching and installing weights
}


class Tracer:
    """Records nothing: what code outside a traced worker gets from :func:`tracer`."""

    enabled = False

    def span(self, name: str, lane: str = "batch", cat: str = "", **args: Any) -> _Span:
        """``with tracer().span("put", "dock_out", samples=8) as args:`` records one complete event
        from entry to exit; ``args`` (a dict) may be filled in inside the block."""
        return _Span(self, name, lane, cat, args)

    def complete(self, name: str, lane: str, start: float, end: float, cat: str = "", **args: Any) -> None:
        """A span measured by the caller: ``start`` and ``end`` from ``time.perf_counter()``."""

    def counter(self, name: str, value: float) -> None:
        """A counter's new value (a ``"C"`` event), now."""

    def close(self) -> None:
        pass


class _Span:
    __slots__ = ("args", "cat", "lane", "name", "start", "tracer")

    def __init__(self, tracer: Tracer, name: str, lane: str, cat: str, args: dict[str, Any]) -> None:
        self.tracer, self.name, self.lane, self.cat, self.args = tracer, name, lane, cat, args
        self.start = 0.0

    def __enter__(self) -> dict[str, Any]:
        self.start = time.perf_counter()
        return self.args

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if et is not None:
            self.args["error"] = et.__name__
        self.tracer.complete(self.name, self.lane, self.start, time.perf_counter(), self.cat, **self.args)


_NULL = Tracer()
_current: contextvars.ContextVar[Tracer] = contextvars.ContextVar("streamrl_tracer", default=_NULL)


def tracer() -> Tracer:
    """The tracer of the stage worker this code runs in (one that records nothing elsewhere)."""
    return _current.get()


def use_tracer(t: Tracer) -> contextvars.Token[Tracer]:
    """Make ``t`` the current task's tracer (and its child tasks'); undo with :func:`reset_tracer`."""
    return _current.set(t)


def reset_tracer(token: contextvars.Token[Tracer]) -> None:
    _current.reset(token)


def stage_pid(stage: str, stages: list[str] | None) -> int:
    """A stage's ``pid`` in the trace: 1 + its index in the pipeline (a stable number otherwise)."""
    if stages is not None and stage in stages:
        return 1 + stages.index(stage)
    return 1000 + zlib.crc32(stage.encode()) % 1_000_000


class TraceWriter(Tracer):
    """One stage worker's trace file (see the module docstring)."""

    enabled = True

    def __init__(self, path: Path, *, stage: str, worker: int, pid: int, workers: int = 1,
                 max_bytes: int = MAX_FILE_BYTES) -> None:
        self.path = path
        self.stage, self.worker, self.pid = stage, worker, pid
        self.max_bytes = max_bytes
        # perf_counter() -> epoch: one offset for the writer's life, so that spans measured from the
        # same readings get the same microseconds (a step and its first part start together, and
        # nest exactly as they ran)
        self._offset_ns = time.time_ns() - time.perf_counter_ns()
        self.version_counter = "policy version" if workers <= 1 else f"policy version (worker {worker})"
        self._lock = threading.Lock()  # spans may end in a worker thread (run_sync)
        self._lanes: set[str] = set()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.written = os.fstat(self._fd).st_size
        self.truncated = False
        if self.written == 0:
            self._write_raw(b"[\n")
        self._meta("process_name", {"name": stage}, tid=0)
        self._meta("process_sort_index", {"sort_index": pid}, tid=0)

    def _tid(self, lane: str) -> int:
        offset, title = LANES.get(lane, (9, lane))
        tid = 10 * self.worker + offset
        if lane not in self._lanes:
            self._lanes.add(lane)
            self._meta("thread_name", {"name": f"worker {self.worker} {title}"}, tid)
            self._meta("thread_sort_index", {"sort_index": tid}, tid)
        return tid

    def _meta(self, name: str, args: dict[str, Any], tid: int) -> None:
        self._event({"name": name, "ph": "M", "pid": self.pid, "tid": tid, "args": args})

    def complete(self, name: str, lane: str, start: float, end: float, cat: str = "", **args: Any) -> None:
        tid = self._tid(lane)
        ts = self._epoch_us(start)
        event: dict[str, Any] = {"name": name, "cat": cat or lane, "ph": "X", "ts": ts,
                                 "dur": max(0, self._epoch_us(end) - ts), "pid": self.pid, "tid": tid}
        if args:
            event["args"] = args
        self._event(event)

    def _epoch_us(self, perf: float) -> int:
        """A ``perf_counter()`` reading as microseconds since the epoch."""
        return (round(perf * 1e9) + self._offset_ns) // 1000

    def counter(self, name: str, value: float) -> None:
        if name == "policy version":
            name = self.version_counter
        self._event({"name": name, "ph": "C", "ts": self._epoch_us(time.perf_counter()), "pid": self.pid, "tid": 10 * self.worker,
                     "args": {"value": value}})

    def _event(self, event: dict[str, Any]) -> None:
        line = json.dumps(event, separators=(",", ":"), default=str).encode() + b",\n"
        with self._lock:
            if self._fd is None or self.truncated:
                return
            if self.written + len(line) > self.max_bytes - 512:  # room for the last word
                self.truncated = True
                last = {"name": f"{CAP_EVENT} ({self.max_bytes} bytes): nothing more recorded",
                        "ph": "i", "s": "p", "ts": self._epoch_us(time.perf_counter()), "pid": self.pid, "tid": 10 * self.worker}
                self._write_raw(json.dumps(last).encode() + b",\n")
                return
            self._write_raw(line)

    def _write_raw(self, data: bytes) -> None:
        assert self._fd is not None
        try:
            os.write(self._fd, data)  # unbuffered: each event is in the file at once
        except OSError as exc:  # a full disk must not fail the stage: stop tracing
            log.warning("trace %s: %s; recording nothing more", self.path, exc)
            self.truncated = True
            return
        self.written += len(data)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def open_tracer(run_dir: Path, stage: str, worker: int, *, workers: int = 1, stages: list[str] | None = None,
                max_bytes: int = MAX_FILE_BYTES) -> TraceWriter:
    """The trace writer of stage ``stage``'s worker ``worker`` in ``run_dir``."""
    return TraceWriter(run_dir / TRACE_DIR / f"{stage}-{worker}.json", stage=stage, worker=worker,
                       pid=stage_pid(stage, stages), workers=workers, max_bytes=max_bytes)


# --------------------------------------------------------------------------- merging


class TraceError(ValueError):
    """No trace to merge; the message says why and what to do."""


def read_events(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The events of one worker file and how many lines were not events (a line cut short by a
    crash, a stray closing bracket excepted)."""
    events: list[dict[str, Any]] = []
    bad = 0
    with path.open("rb") as f:
        for raw in f:
            line = raw.strip().rstrip(b",")
            if line in (b"", b"[", b"]"):
                continue
            try:
                event = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if isinstance(event, dict) and "ph" in event:
                events.append(event)
            else:
                bad += 1
    return events, bad


def _merged(per_file: list[list[dict[str, Any]]]) -> Iterator[dict[str, Any]]:
    """Metadata first (once each: a restarted worker names its tracks again), then by time."""
    seen_meta: set[tuple[Any, ...]] = set()
    timed: list[dict[str, Any]] = []
    for events in per_file:
        for e in events:
            if e["ph"] == "M":
                key = (e.get("pid"), e.get("tid"), e.get("name"), json.dumps(e.get("args"), sort_keys=True))
                if key not in seen_meta:
                    seen_meta.add(key)
                    yield e
            else:
                timed.append(e)
    timed.sort(key=lambda e: e.get("ts", 0))
    yield from timed


def merge_trace(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Merge the workers' trace files of ``run_dir`` into ``out`` (default ``RUN_DIR/trace.json``,
    replaced atomically); returns its path. Works on a running, finished or crashed run."""
    run_dir = Path(run_dir)
    files = sorted((run_dir / TRACE_DIR).glob("*.json"))
    if not files:
        if not (run_dir / "config.yaml").is_file():
            raise TraceError(f"{run_dir}: not a run directory (no config.yaml); pass the directory `streamrl run` "
                             "printed as its run dir")
        raise TraceError(f"{run_dir}: no trace files in {run_dir / TRACE_DIR} (the run had output.trace: false, "
                         "or no worker has started yet)")
    dest = Path(out) if out is not None else run_dir / TRACE_FILE
    per_file, skipped = [], 0
    for path in files:
        events, bad = read_events(path)
        per_file.append(events)
        skipped += bad
    capped = [p.stem for p, events in zip(files, per_file, strict=True)
              if any(str(e.get("name", "")).startswith(CAP_EVENT) for e in events[-3:])]
    tmp = dest.with_name(dest.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.write('{"displayTimeUnit":"ms","otherData":')
        f.write(json.dumps({"run_dir": str(run_dir.resolve()), "workers": [p.stem for p in files],
                            "skipped_lines": skipped, "capped": capped}))
        f.write(',"traceEvents":[\n')
        first = True
        for event in _merged(per_file):
            if not first:
                f.write(",\n")
            f.write(json.dumps(event, separators=(",", ":")))
            first = False
        f.write("\n]}\n")
    tmp.replace(dest)
    return dest


def finish_trace(run_dir: Path, enabled: bool) -> Path | None:
    """The launcher's last step of a run: merge the trace; a failure is logged, never raised."""
    if not enabled or not (run_dir / TRACE_DIR).is_dir():
        return None
    try:
        return merge_trace(run_dir)
    except Exception as exc:  # the trace is a diagnostic: the run's result stands without it
        log.warning("could not merge the trace of %s: %s", run_dir, exc)
        return None
