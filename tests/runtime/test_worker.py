"""The worker loop against a real dock (servers in threads) and a real control channel, driven by hand.

Checks what the launcher cannot see: the samples a failing stage held are not lost (another
worker can claim them), and a finished worker wrote and acked every sample.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any

import anyio
import pytest

from streamrl.config import load_config
from streamrl.dock.client import DockClient
from streamrl.dock.launch import ThreadDock
from streamrl.runtime import control as c
from streamrl.runtime.pipeline import StageSpec
from streamrl.runtime.worker import BEGIN_REPORT_S, WorkerSpec, run_worker

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

N = 12


async def _drive(spec: WorkerSpec, server: c.ControlServer, stop_after_s: float | None = None
                 ) -> tuple[int, list[Any]]:
    """Run the worker as a task, answer its Ready with Go, collect its events until it returns.
    ``stop_after_s``: send Stop that long after Go (noted among the events as ``("stop", time)``)."""
    events: list[Any] = []
    codes: list[int] = []
    async with anyio.create_task_group() as tg:
        async def worker() -> None:
            codes.append(await run_worker(spec))

        async def stop_later() -> None:
            await anyio.sleep(stop_after_s or 0.0)
            events.append(("stop", anyio.current_time()))
            await server.broadcast(c.Stop("stop reward reached"))

        tg.start_soon(worker)
        with anyio.fail_after(30):
            while True:
                event = await server.recv()
                events.append(event)
                if isinstance(event, c.Ready):
                    await server.broadcast(c.Go())
                    if stop_after_s is not None:
                        tg.start_soon(stop_later)
                if isinstance(event, (c.Failed, c.Finished)):
                    break
    return codes[0], events


async def _run_one(run_dir: Path, options: dict[str, Any], lease_ttl_s: float, reclaim: bool = True, *,
                   cls: str = "tests.runtime.user_stages:Doubler", writes: tuple[str, ...] = ("y",)
                   ) -> tuple[int, list[Any], dict[str, Any], list[dict[str, Any]], list[int] | None]:
    """One worker of a stage named "double" (class ``cls``, a Doubler unless said) over N samples in
    a fresh dock. Returns its exit code, its control events, the controller's statistics right after
    it returned, the batches it saw, and the indices another worker can then claim after a failure
    (None unless ``reclaim``)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    # a second consumer that never claims keeps every sample's data readable after "double" acked
    dock = ThreadDock(["double", "later"], capacity=64).start()
    server = c.ControlServer("tcp://127.0.0.1:0")
    try:
        async with DockClient(dock.controller_endpoint, lease_ttl_s=lease_ttl_s) as client:
            await client.add({"x": list(range(N))}, group_size=1)
            await client.close_input()
            cfg = load_config({"resources": {"launch": "inprocess", "dock": {"lease_ttl_s": lease_ttl_s}}})
            stage = StageSpec(name="double", cls=cls, reads=["x"], writes=list(writes), micro_batch=4, options=options)
            spec = WorkerSpec(config=cfg, stage=stage, worker=0, dock_endpoint=dock.controller_endpoint,
                              control_endpoint=server.endpoint, weights_endpoint=f"ipc://{run_dir}/no-publisher",
                              run_dir=str(run_dir))
            code, events = await _drive(spec, server)
            stats = (await client.server_statistics())["controller"]
            batches = [json.loads(line) for line in (run_dir / "double-batches.jsonl").read_text().splitlines()]
            reclaimed = None
            if code != 0 and reclaim:
                # another worker of the stage: it must get every sample that was not done
                with anyio.fail_after(lease_ttl_s + 10):
                    got: list[int] = []
                    while len(got) < N - stats["consumers"]["double"]["done"]:
                        lease = await client.claim("double", ["x"], N, timeout=lease_ttl_s + 5)
                        values = await client.fetch(lease.indices, ["x"])
                        assert values["x"] == lease.indices  # the data is intact (x = the sample's index)
                        await client.ack(lease)
                        got += lease.indices
                reclaimed = sorted(got)
            elif code == 0 and "y" in writes:
                values = await client.fetch(list(range(N)), ["x", "y"])
                assert values["y"] == [2 * x for x in values["x"]]
            return code, events, stats, batches, reclaimed
    finally:
        server.close()
        dock.stop()


async def test_a_failing_stage_reports_its_samples_and_loses_none(tmp_path: Path) -> None:
    code, events, stats, batches, reclaimed = await _run_one(tmp_path, {"fail_on": [6]}, lease_ttl_s=1.0)
    assert code == 1
    failed = events[-1]
    assert isinstance(failed, c.Failed)
    held = next(b["indices"] for b in batches if 6 in b["x"])
    assert (failed.stage, failed.worker, failed.indices) == ("double", 0, held)
    assert "user stage refuses x in [6]" in failed.message + failed.traceback
    done = [i for b in batches if 6 not in b["x"] for i in b["indices"]]
    assert stats["consumers"]["double"]["done"] == len(done)
    # nothing lost: every sample not done, the failed batch included, goes to another worker
    assert reclaimed == sorted(set(range(N)) - set(done))
    assert set(held) <= set(reclaimed)


async def test_a_failing_stage_releases_every_lease_at_once(tmp_path: Path) -> None:
    """The worker doc: 'On failure the leased samples are released back to the dock.' Repeated,
    because what the prefetcher is doing at that moment is a race.

    Bug found: _prefetching_loop releases the failed batch while its fetcher task is still sending
    the next claim; the controller grants that claim (often the very samples just released), the
    fetcher is cancelled before the reply arrives, DockClient._reader drops the reply as late, and
    the lease stays on the controller until lease_ttl_s instead of being released at once. Found
    again (about 1 run in 20): the cancel and the grant's reply in one turn of the event loop, the
    reply first (tests/dock/test_client.py::test_a_claim_cancelled_in_the_loop_turn_its_grant_arrives_in_is_released)."""
    leaked = []
    for k in range(12):
        _, _, stats, _, _ = await _run_one(tmp_path / f"round-{k}", {"fail_on": [6]}, lease_ttl_s=30.0,
                                          reclaim=False)
        if stats["leases"] or stats["claimed"]:
            leaked.append((k, stats["leases"], stats["claimed"]))
            break
    assert not leaked, f"leases left on the controller after the worker returned (round, leases, samples): {leaked}"


@pytest.mark.parametrize("stop_after", [None, 2])
async def test_a_stage_that_writes_nothing_has_every_batch_acked_when_it_returns(tmp_path: Path,
                                                                                 stop_after: int | None) -> None:
    """A stage that sizes its own claims and writes nothing (as the trainer does) acks each batch:
    when the worker returns, having run out of samples or raised StopRun, every batch it took is
    acked and no lease is left."""
    code, events, stats, batches, _ = await _run_one(tmp_path, {"n": 4, "stop_after": stop_after}, lease_ttl_s=30.0,
                                                     reclaim=False, cls="tests.runtime.user_stages:Taker", writes=())
    taken = [b["indices"] for b in batches]
    assert code == 0 and len(taken) == (N // 4 if stop_after is None else stop_after)
    assert stop_after is None or any(isinstance(e, c.StopRequest) for e in events)
    assert stats["consumers"]["double"]["done"] == sum(len(t) for t in taken)
    assert (stats["leases"], stats["claimed"]) == (0, 0)


async def test_a_finished_worker_wrote_and_acked_every_sample(tmp_path: Path) -> None:
    code, events, stats, batches, _ = await _run_one(tmp_path, {}, lease_ttl_s=30.0)
    assert code == 0
    # Starting as it connects (a Stop reaches it from then on), Ready after set-up, Finished last
    assert isinstance(events[0], c.Starting) and isinstance(events[1], c.Ready) and isinstance(events[-1], c.Finished)
    assert sorted(i for b in batches for i in b["indices"]) == list(range(N))
    busy = [e for e in events if isinstance(e, c.StageBusy)]
    assert busy and busy[-1].samples == N  # the last busy report counts every sample
    assert stats["consumers"]["double"]["done"] == N and stats["leases"] == 0


async def test_busy_time_counts_while_a_batch_runs(tmp_path: Path) -> None:
    """A long batch's time reaches the launcher as it runs (every BUSY_REPORT_S), not in one lump
    when it ends: busy/<stage> then stays a fraction of each step's wall time."""
    code, events, _, _, _ = await _run_one(tmp_path, {"sleep_s": 1.2}, lease_ttl_s=30.0)
    assert code == 0
    busy = [e for e in events if isinstance(e, c.StageBusy)]
    in_flight = [e for e in busy if e.batches == 0]  # reported before the first batch ended
    assert in_flight and 0.2 < max(e.busy_s for e in in_flight) <= 1.3, [(e.batches, e.busy_s) for e in busy]
    assert busy[-1].samples == N and busy[-1].busy_s >= 1.2 * busy[-1].batches * 0.9


async def test_a_batch_is_reported_running_only_once_it_has_run_a_while(tmp_path: Path) -> None:
    """A batch that ends within BEGIN_REPORT_S is reported once, when it ends (the busy reports were
    most of the launcher's events); a longer one is reported running too, before it ends."""
    code, events, _, _, _ = await _run_one(tmp_path / "short", {}, lease_ttl_s=30.0)
    busy = [e for e in events if isinstance(e, c.StageBusy)]
    assert code == 0 and busy[-1].batches == N // 4
    # (a periodic report could land inside a batch; these batches take microseconds)
    assert not [e for e in busy if e.in_batch_s > 0], [(e.batches, e.in_batch_s) for e in busy]
    assert {e.batches for e in busy} >= {1, 2, 3}  # each batch's end

    code, events, _, _, _ = await _run_one(tmp_path / "long", {"sleep_s": 0.1}, lease_ttl_s=30.0)
    # (the timer may fire a clock tick early; a periodic report may also land inside a batch)
    running = [e for e in events if isinstance(e, c.StageBusy) and e.in_batch_s >= 0.9 * BEGIN_REPORT_S]
    assert code == 0 and {e.batches for e in running} == {0, 1, 2}  # each of the 3 batches, while it ran


async def test_a_batchs_own_figures_ride_the_busy_report_that_ends_it(tmp_path: Path) -> None:
    """Figures a stage reports in a batch (``ctx.report_metrics``) reach the launcher in the busy
    report that ends the batch (sent before its outputs are put), not as an event of their own."""
    code, events, _, batches, _ = await _run_one(tmp_path, {"figures": True}, lease_ttl_s=30.0)
    assert code == 0 and not [e for e in events if isinstance(e, c.StageMetrics)]
    carried = [(e.batches, e.metrics) for e in events if isinstance(e, c.StageBusy) and e.metrics]
    assert carried == [(k + 1, {"max_x": float(max(b["x"]))}) for k, b in enumerate(batches)]
    assert all(e.in_batch_s == 0 for e in events if isinstance(e, c.StageBusy) and e.metrics)


async def test_a_stop_ends_a_worker_at_once_though_its_claim_waits_for_samples(tmp_path: Path) -> None:
    """A run that stops (its stop reward reached) finds its stages waiting for samples that will not
    come: the Stop cuts their claims short, and the worker finishes without waiting for the
    controller's answer to them (it held the claim for up to a second more at every run's end)."""
    dock = ThreadDock(["double"], capacity=64).start()  # no samples: the worker's claim waits
    server = c.ControlServer("tcp://127.0.0.1:0")
    try:
        cfg = load_config({"resources": {"launch": "inprocess"}})
        stage = StageSpec(name="double", cls="tests.runtime.user_stages:Doubler", reads=["x"], writes=["y"],
                          micro_batch=4)
        spec = WorkerSpec(config=cfg, stage=stage, worker=0, dock_endpoint=dock.controller_endpoint,
                          control_endpoint=server.endpoint, weights_endpoint=f"ipc://{tmp_path}/no-publisher",
                          run_dir=str(tmp_path))
        code, events = await _drive(spec, server, stop_after_s=0.3)  # the stage loop is in its claim by then
        took = anyio.current_time() - next(e[1] for e in events if isinstance(e, tuple))
        assert code == 0 and took < 0.5, took
    finally:
        server.close()
        dock.stop()


async def test_a_failing_source_leaves_no_report_to_a_closed_channel(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A produce() that raises leaves its batch unended, and the batch's running report is still
    due BEGIN_REPORT_S later, after the worker closed its control channel: it must not be sent."""
    dock = ThreadDock(["look"], capacity=64).start()
    server = c.ControlServer("tcp://127.0.0.1:0")
    try:
        cfg = load_config({"resources": {"launch": "inprocess"}})
        stage = StageSpec(name="source", cls="tests.runtime.user_stages:CountingSource", writes=["x", "tag"],
                          options={"n": 16, "fail_after": 4})
        spec = WorkerSpec(config=cfg, stage=stage, worker=0, dock_endpoint=dock.controller_endpoint,
                          control_endpoint=server.endpoint, weights_endpoint=f"ipc://{tmp_path}/no-publisher",
                          run_dir=str(tmp_path))
        code, events = await _drive(spec, server)
        await anyio.sleep(5 * BEGIN_REPORT_S)  # the report's moment has passed
        gc.collect()  # a send on the closed socket fails in a future that is logged when collected
    finally:
        server.close()
        dock.stop()
    assert code == 1 and isinstance(events[-1], c.Failed) and "user source fails" in events[-1].message
    assert not [r.getMessage() for r in caplog.records if r.name == "asyncio"]


@pytest.mark.parametrize("core_share", [True, False])
async def test_compute_calls_take_their_share_of_the_hosts_cores(tmp_path: Path, core_share: bool) -> None:
    """With resources.core_share a compute call marks its thread in the run's shared-memory
    directory and gets its stage's threads while it computes alone; without, nothing is marked."""
    import os

    import torch

    run_dir, shm = tmp_path / "run", tmp_path / "shm"
    run_dir.mkdir()
    dock = ThreadDock(["look"], capacity=64).start()
    server = c.ControlServer("tcp://127.0.0.1:0")
    threads_before = torch.get_num_threads()
    try:
        async with DockClient(dock.controller_endpoint) as client:
            await client.add({"x": list(range(N))}, group_size=1)
            await client.close_input()
            cfg = load_config({"resources": {"launch": "inprocess", "core_share": core_share}})
            stage = StageSpec(name="look", cls="tests.runtime.user_stages:ThreadLooker", reads=["x"], writes=["y"],
                              micro_batch=4, threads=2)
            spec = WorkerSpec(config=cfg, stage=stage, worker=0, dock_endpoint=dock.controller_endpoint,
                              control_endpoint=server.endpoint, weights_endpoint=f"ipc://{run_dir}/no-publisher",
                              run_dir=str(run_dir), shm_dir=str(shm))
            code, _ = await _drive(spec, server)
    finally:
        server.close()
        dock.stop()
        torch.set_num_threads(threads_before)
    assert code == 0
    looks = [json.loads(line) for line in (run_dir / "look-threads.jsonl").read_text().splitlines()]
    assert len(looks) == N // 4
    for look in looks:
        if core_share:  # this worker alone computes: its own marker, the stage's threads (at most the cores)
            assert look["markers"] == [f"{os.getpid()}-{m.split('-')[1]}" for m in look["markers"]]
            assert len(look["markers"]) == 1
            assert look["threads"] == min(2, len(os.sched_getaffinity(0)))
        else:
            assert look["markers"] is None
    if core_share:
        assert os.listdir(shm / "cores") == []  # every call took its marker away


def test_the_event_loop_thread_computes_on_one_torch_thread_and_compute_threads_on_the_stages() -> None:
    """``pin_event_loop_thread``: the event loop's thread keeps one torch thread even after a
    compute thread set more and the loop ran a large op (so it never makes an OpenMP team beside
    the compute thread's); a thread started later gets the stage's threads. In a fresh
    interpreter: torch's thread counts are process state."""
    import subprocess
    import sys

    probe = """
import threading, torch
from streamrl.runtime.worker import pin_event_loop_thread
pin_event_loop_thread(3)
seen = []
def compute():
    seen.append(torch.get_num_threads())
    torch.set_num_threads(2)  # what the core share does in a compute call
    torch.randn(1 << 20).mul_(2.0)
t = threading.Thread(target=compute); t.start(); t.join()
torch.randn(1 << 20).mul_(2.0)  # the event loop's own large op (a message copy, a snapshot)
print(seen[0], torch.get_num_threads())
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["3", "1"], out.stdout + out.stderr


def test_a_busy_report_never_shrinks_the_finished_seconds_the_launcher_derives(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's busy report says its busy seconds (the running batch's included) and the running
    batch's seconds; the launcher takes the difference as its finished batches' seconds, and one
    that shrinks as a restarted worker's, counting its whole history again (a CI run's trainer
    row counted busy all through a step that way). Both come from one clock reading, so a thread
    that waits between two readings (for the GIL) changes neither the difference nor the row."""
    import asyncio
    import time

    from streamrl.runtime.worker import _Meter

    class Control:
        closed = False
        hold_figures = False
        before_step = None

        def __init__(self) -> None:
            self.reports: list[tuple[float, float]] = []

        def busy(self, busy_s: float, batches: int, samples: int, in_batch_s: float, measured_at: float) -> None:
            self.reports.append((busy_s, in_batch_s))

    # the batch begins at 10.0; the first report's thread waits 0.1 s between two readings (10.5,
    # 10.6), the second's does not (11.0, 11.0000001)
    readings = iter([10.0, 10.5, 10.6, 11.0, 11.0000001])
    monkeypatch.setattr(time, "perf_counter", lambda: next(readings))
    control = Control()
    meter = _Meter(control, "train")  # type: ignore[arg-type]

    async def batch() -> None:
        meter.begin()
        meter.flush()
        meter.flush()

    asyncio.run(batch())
    finished = [busy - in_batch for busy, in_batch in control.reports]
    assert finished == [0.0, 0.0]  # before: 0.1, then 1e-7 (a "restart")
    assert [in_batch for _, in_batch in control.reports] == [pytest.approx(0.5), pytest.approx(0.6)]
