"""The timeline trace (streamrl.metrics.trace): per-worker files written by real processes, merged into
one Chrome trace (a JSON object with traceEvents), also after a crash, within a size cap."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import anyio
import pytest

from streamrl.metrics.trace import (
    TRACE_DIR,
    TraceError,
    TraceWriter,
    merge_trace,
    open_tracer,
    read_events,
    reset_tracer,
    tracer,
    use_tracer,
)

REPO = Path(__file__).resolve().parents[2]


def _worker(run_dir: Path, stage: str, worker: int, n: int, *extra: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "tests.metrics.trace_worker", str(run_dir), stage, str(worker),
                             str(n), *extra], env=env, cwd=REPO)


def _load(path: Path) -> dict[str, Any]:
    trace = json.loads(path.read_text())
    assert set(trace) >= {"traceEvents", "displayTimeUnit"} and trace["displayTimeUnit"] == "ms"
    for e in trace["traceEvents"]:
        assert e["ph"] in {"X", "C", "M", "i"} and isinstance(e["pid"], int)
        if e["ph"] == "X":
            assert isinstance(e["ts"], int) and isinstance(e["dur"], int) and e["dur"] >= 0
    return trace


def assert_spans_nest(events: list[dict[str, Any]]) -> None:
    """On every track, a span that starts inside another ends inside it too (as Perfetto needs)."""
    tracks: dict[tuple[int, int], list[tuple[int, int, str]]] = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            tracks[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    for track, spans in tracks.items():
        spans.sort(key=lambda s: (s[0], -s[1]))
        open_spans: list[tuple[int, int, str]] = []
        for start, end, name in spans:
            while open_spans and open_spans[-1][1] <= start:
                open_spans.pop()
            assert not open_spans or end <= open_spans[-1][1], (track, name, open_spans[-1])
            open_spans.append((start, end, name))


def test_two_processes_merge_into_one_trace_on_one_time_axis(tmp_path: Path) -> None:
    first_done = tmp_path / "first.done"
    a = _worker(tmp_path, "generate", 0, 5, "-", str(first_done))
    b = _worker(tmp_path, "train", 1, 5, str(first_done))  # starts only once the first has finished
    assert a.wait(timeout=60) == 0 and b.wait(timeout=60) == 0
    assert sorted(p.name for p in (tmp_path / TRACE_DIR).iterdir()) == ["generate-0.json", "train-1.json"]

    path = merge_trace(tmp_path)
    assert path == tmp_path / "trace.json"
    trace = _load(path)
    events = trace["traceEvents"]
    assert trace["otherData"]["workers"] == ["generate-0", "train-1"] and trace["otherData"]["skipped_lines"] == 0
    names = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {(2, "generate"), (3, "train")}  # pid: 1 + the stage's index in the pipeline
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert threads == {(2, 0): "worker 0 batches", (2, 2): "worker 0 dock reserve/put/ack",
                       (3, 10): "worker 1 batches", (3, 12): "worker 1 dock reserve/put/ack"}
    # metadata first, then by time
    kinds = [e["ph"] for e in events]
    assert kinds.index("X") > max(i for i, k in enumerate(kinds) if k == "M")
    timed = [e["ts"] for e in events if e["ph"] != "M"]
    assert timed == sorted(timed)

    spans = [e for e in events if e["ph"] == "X"]
    batches = {pid: [e for e in spans if e["pid"] == pid and e["name"] == "process"] for pid in (2, 3)}
    assert [e["args"] for e in batches[2]] == [{"samples": 8, "version": k} for k in range(5)]
    assert all(e["dur"] >= 1000 for e in batches[2])  # each holds a 1 ms put
    # timestamps are comparable across processes: the second process's spans all come after the first's
    assert max(e["ts"] + e["dur"] for e in batches[2]) <= min(e["ts"] for e in batches[3])
    assert_spans_nest(events)
    counters = [e for e in events if e["ph"] == "C"]
    assert {e["name"] for e in counters} == {"policy version (worker 0)", "policy version (worker 1)"}
    assert [e["args"]["value"] for e in counters if e["pid"] == 2] == list(range(5))


def test_a_killed_worker_leaves_a_file_that_merges(tmp_path: Path) -> None:
    started = tmp_path / "started"
    proc = _worker(tmp_path, "generate", 0, 20, "-", str(started), "forever")
    deadline = time.monotonic() + 60
    while not started.exists():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    path = tmp_path / TRACE_DIR / "generate-0.json"
    with path.open("ab") as f:
        f.write(b'{"name":"process","ph":"X","ts":17')  # a line cut short, as a crash mid-write leaves
    events, bad = read_events(path)
    assert bad == 1 and sum(e["name"] == "process" for e in events) >= 20
    trace = _load(merge_trace(tmp_path, tmp_path / "out.json"))
    assert trace["otherData"]["skipped_lines"] == 1
    assert sum(e["name"] == "process" for e in trace["traceEvents"]) == sum(e["name"] == "process" for e in events)
    assert_spans_nest(trace["traceEvents"])


def test_a_file_stops_at_its_cap_and_says_so(tmp_path: Path) -> None:
    writer = TraceWriter(tmp_path / TRACE_DIR / "score-0.json", stage="score", worker=0, pid=3, max_bytes=8192)
    for k in range(1000):
        with writer.span("process", "batch", samples=k):
            pass
    writer.close()
    size = (tmp_path / TRACE_DIR / "score-0.json").stat().st_size
    assert size <= 8192
    events, bad = read_events(tmp_path / TRACE_DIR / "score-0.json")
    assert bad == 0 and 10 < len(events) < 1000
    assert events[-1]["ph"] == "i" and events[-1]["name"].startswith("trace file cap reached")
    (tmp_path / "config.yaml").write_text("{}\n")
    trace = _load(merge_trace(tmp_path))
    assert trace["otherData"]["capped"] == ["score-0"]


def test_a_restarted_worker_appends_and_its_tracks_are_named_once(tmp_path: Path) -> None:
    for _ in range(2):  # the worker, then its restart
        t = open_tracer(tmp_path, "generate", 0, stages=["source", "generate"])
        with t.span("process", "batch"):
            pass
        t.close()
    text = (tmp_path / TRACE_DIR / "generate-0.json").read_text()
    assert text.startswith("[\n") and text.count("[") == 1  # the JSON array format, opened once
    events = _load(merge_trace(tmp_path))["traceEvents"]
    assert sum(e["name"] == "process" for e in events) == 2
    assert sum(e["name"] == "process_name" for e in events) == 1
    assert sum(e["name"] == "thread_name" for e in events) == 1


def test_a_span_records_its_error_and_code_outside_a_worker_records_nothing(tmp_path: Path) -> None:
    assert not tracer().enabled
    with tracer().span("claim", "dock_in", samples=3) as args:  # nothing written anywhere
        args["x"] = 1
    t = open_tracer(tmp_path, "train", 0)
    token = use_tracer(t)
    try:
        with contextlib.suppress(ValueError), tracer().span("claim", "dock_in", "dock", asked=8):
            raise ValueError("boom")
    finally:
        t.close()
    reset_tracer(token)
    assert not tracer().enabled
    events, _ = read_events(tmp_path / TRACE_DIR / "train-0.json")
    (span,) = [e for e in events if e["ph"] == "X"]
    assert span["args"] == {"asked": 8, "error": "ValueError"} and span["cat"] == "dock" and span["tid"] == 1
    assert span["pid"] >= 1000  # a stage outside a known pipeline still gets a stable pid


@pytest.mark.anyio
async def test_each_task_records_into_its_own_workers_file(tmp_path: Path) -> None:
    """Colocated stages run as tasks of one process: each stage worker's spans go to its own file."""

    async def stage_worker(stage: str) -> None:
        t = open_tracer(tmp_path, stage, 0, stages=["generate", "train"])
        use_tracer(t)
        for _ in range(3):
            with tracer().span("process", "batch"):
                await anyio.sleep(0.001)
        t.close()

    async with anyio.create_task_group() as tg:
        tg.start_soon(stage_worker, "generate")
        tg.start_soon(stage_worker, "train")
    assert not tracer().enabled  # the tasks' tracers did not leak out
    for stage, pid in (("generate", 1), ("train", 2)):
        events, _ = read_events(tmp_path / TRACE_DIR / f"{stage}-0.json")
        assert [e["pid"] for e in events if e["ph"] == "X"] == [pid] * 3


def test_no_trace_is_an_error_naming_the_directory(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="not a run directory"):
        merge_trace(tmp_path)
    (tmp_path / "config.yaml").write_text("{}\n")
    with pytest.raises(TraceError, match=r"output\.trace: false"):
        merge_trace(tmp_path)


def test_streamrl_trace_merges_and_prints_the_path(tmp_path: Path) -> None:
    t = open_tracer(tmp_path, "generate", 0)
    with t.span("process", "batch"):
        pass
    t.close()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "streamrl.cli", "trace", str(tmp_path)], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(tmp_path / "trace.json")
    assert sum(e["name"] == "process" for e in _load(tmp_path / "trace.json")["traceEvents"]) == 1
    bad = subprocess.run([sys.executable, "-m", "streamrl.cli", "trace", str(tmp_path / "nope")], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "not a run directory" in bad.stderr
