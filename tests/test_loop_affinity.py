"""streamrl.loop_affinity: a process's event loop and ZeroMQ I/O threads pinned to one core, and
threads that compute given every core back. Each check runs in a fresh interpreter (affinity is
the process's own state: pinning pytest's thread would move every later test), on Linux."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from streamrl.dock.launch import LocalDock
from streamrl.loop_affinity import assign, cores

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 60

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux's")


def _python(code: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=TIMEOUT_S, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _allowed(pid: int, tid: int) -> str:
    """A thread's CPU list (its Cpus_allowed_list)."""
    status = Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines()
    return next(line.split()[1] for line in status if line.startswith("Cpus_allowed_list"))


def _pinned(pid: int, core: int) -> bool:
    """The process's main thread and its ZeroMQ threads are all on ``core`` alone."""
    try:
        tids = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()
                if t.name == str(pid) or (t / "comm").read_text().startswith("ZMQbg/")]
        return len(tids) >= 3 and all(_allowed(pid, tid) == str(core) for tid in tids)
    except OSError:  # a thread that ended meanwhile: look again
        return False


def test_cores_are_assigned_round_robin_in_launch_order() -> None:
    available = cores()
    assert available == sorted(os.sched_getaffinity(0))
    assert assign(2 * len(available) + 1) == [*available, *available, available[0]]


def test_the_loop_thread_and_zeromq_threads_pin_and_a_computing_thread_gets_every_core_back() -> None:
    got = _python("""
        import json, os, threading, time, zmq
        from streamrl import loop_affinity
        def zmq_tids(n):  # a ZeroMQ thread names itself once it runs: wait for n of them (bounded)
            deadline = time.monotonic() + 10
            while True:
                tids = [int(t) for t in os.listdir("/proc/self/task")
                        if open(f"/proc/self/task/{t}/comm").read().startswith("ZMQbg/")]
                if len(tids) >= n or time.monotonic() > deadline:
                    return tids
                time.sleep(0.01)
        everything = sorted(os.sched_getaffinity(0))
        core = everything[-1]
        early = zmq.Context(); early.socket(zmq.DEALER)  # its I/O thread runs before the pin
        zmq_tids(2)
        loop_affinity.pin_loop_threads(core)
        late = zmq.Context(); late.socket(zmq.DEALER)  # started by the pinned thread
        seen = {}
        def compute():
            seen["started"] = sorted(os.sched_getaffinity(0))
            loop_affinity.release_this_thread()
            seen["released"] = sorted(os.sched_getaffinity(0))
        t = threading.Thread(target=compute); t.start(); t.join()
        zmq_threads = [sorted(os.sched_getaffinity(tid)) for tid in zmq_tids(4)]
        print(json.dumps({"core": core, "everything": everything, "loop": sorted(os.sched_getaffinity(0)),
                          "zmq": zmq_threads, **seen}))
    """)
    core = got["core"]
    assert got["loop"] == [core]
    assert len(got["zmq"]) >= 4 and all(c == [core] for c in got["zmq"])  # both contexts' I/O and reaper threads
    assert got["started"] == [core]  # a thread the loop starts inherits its core ...
    assert got["released"] == got["everything"]  # ... until it gives itself every core back


def test_a_stage_computes_on_every_core_while_its_loop_is_pinned(tmp_path: Path) -> None:
    """StageContext.run_sync's thread, started by the pinned event loop, computes on every core."""
    got = _python(f"""
        import json, os, anyio
        from pathlib import Path
        from streamrl import loop_affinity
        from streamrl.config import load_config
        from streamrl.runtime.pipeline import StageSpec
        from streamrl.runtime.stage import StageContext
        spec = StageSpec(name="s", cls="tests.runtime.user_stages:Doubler", reads=["x"], writes=["y"])
        ctx = StageContext(config=load_config({{}}), spec=spec, worker=0, run_dir=Path({str(tmp_path)!r}),
                           device="cpu", policy=None, control=None, weights_endpoint="")
        async def main():
            loop_affinity.pin_loop_threads(sorted(os.sched_getaffinity(0))[0])
            computed = await ctx.run_sync(lambda: sorted(os.sched_getaffinity(0)))
            return sorted(os.sched_getaffinity(0)), computed
        loop, computed = anyio.run(main)
        print(json.dumps({{"loop": loop, "computed": computed}}))
    """)
    assert len(got["loop"]) == 1
    assert got["computed"] == cores()


def test_dock_servers_pin_their_threads_to_the_cores_they_are_given() -> None:
    first, last = cores()[0], cores()[-1]
    with LocalDock(consumers=["c"], capacity=8, n_warehouses=1, transport="ipc", loop_cores=[last, first]) as dock:
        controller, warehouse = dock.pids
        deadline = time.monotonic() + 20  # each pins itself right after it printed READY
        while not (_pinned(controller, last) and _pinned(warehouse, first)):
            assert time.monotonic() < deadline, "the dock servers' threads were not pinned"
            time.sleep(0.05)
