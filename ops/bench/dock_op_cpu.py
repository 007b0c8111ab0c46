#!/usr/bin/env python3
"""CPU per dock operation, in the client and in each server, against a raw zmq.asyncio round trip.

A small model's step is mostly dock hops (docs/benchmarks.md §27, §31): each stage claims,
fetches and puts once per micro-batch, and every one of those costs CPU in the stage's process,
the controller and the warehouse. This measures that cost one operation kind at a time, against
the floor of the same transport: a ``zmq.asyncio`` DEALER's round trip to a synchronous ROUTER
that echoes (one small frame, the same ipc transport, the same event loop).

Set-up: a real dock (``LocalDock``: a controller and one warehouse, each its own process, ipc
sockets) and one ``DockClient`` on uvloop, as a stage worker has them. Each repetition runs
``--iters`` operations of each kind in turn, one at a time (no other request in flight), on
samples of one column of W1's shape (8 prompt tokens, int64): ``reserve`` (one sample),
``put`` (its column; the warehouse tells the controller), ``claim`` (one sample), ``fetch``
(its column) and ``ack``. CPU is each process's user + system time (``/proc/PID/stat``; the
client's ``getrusage``, its zmq I/O thread included) over the operations, divided by their
number; the baseline's likewise per round trip.

    python ops/bench/dock_op_cpu.py                  # about 15 seconds
    python ops/bench/dock_op_cpu.py --reps 5 --iters 2000

A second floor: the same round trip on a plain socket served by the event loop
(``streamrl.loop_socket.LoopSocket``, what the dock client's sockets are).

Last line: one JSON object. Its ratio is the client's mean CPU per operation over the raw
``zmq.asyncio`` round trip's client CPU, and over the LoopSocket round trip's: what the dock client
adds to each request (a breakdown: no target).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import anyio
import torch
import zmq
import zmq.asyncio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt_spread, print_json_line, print_table, spread
from dock import _cpu_seconds

from streamrl.dock.client import DockClient
from streamrl.dock.launch import LocalDock
from streamrl.event_loop import backend_options
from streamrl.loop_socket import LoopSocket

OPS = ("reserve", "put", "claim", "fetch", "ack")
WARMUP = 50

_ECHO_SERVER = textwrap.dedent("""
    import sys, zmq
    sock = zmq.Context().socket(zmq.ROUTER)
    sock.bind(sys.argv[1])
    print("ready", flush=True)
    while True:
        sock.send_multipart(sock.recv_multipart())
""")


def _cpu_s(pid: int | None = None) -> float:
    """User + system seconds of this process (None) or of ``pid``."""
    if pid is None:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    return _cpu_seconds(pid)


async def _dock_ops(iters: int) -> dict[str, dict[str, float]]:
    """µs of CPU per operation of each kind: {op: {"client", "controller", "warehouse"}}."""
    column = torch.arange(8, dtype=torch.int64)
    with LocalDock(consumers=["stage"], capacity=4 * (iters + WARMUP), transport="ipc") as dock:
        controller, warehouse = (p.pid for p in dock._procs)
        async with DockClient(dock.controller_endpoint, client_id="bench") as client:
            for _ in range(WARMUP):  # connections, first allocations, the consumer's view
                await client.add({"x": [column]})
                lease = await client.claim("stage", ["x"], 1, timeout=5)
                await client.fetch(lease.indices, ["x"])
                await client.ack(lease)
            out: dict[str, dict[str, float]] = {}
            reserved: list[list[int]] = []
            leases: list[Any] = []
            fetched = iter(leases)  # (filled by the claims before the fetches begin)

            async def reserve() -> None:
                reserved.append(await client.reserve(1))

            async def put() -> None:
                await client.put(reserved.pop(), {"x": [column]})

            async def claim() -> None:
                leases.append(await client.claim("stage", ["x"], 1, timeout=5))

            async def fetch() -> None:
                await client.fetch(next(fetched).indices, ["x"])

            async def ack() -> None:
                await client.ack(leases.pop())

            for name, op in zip(OPS, (reserve, put, claim, fetch, ack), strict=True):
                before = (_cpu_s(), _cpu_s(controller), _cpu_s(warehouse))
                for _ in range(iters):
                    await op()
                after = (_cpu_s(), _cpu_s(controller), _cpu_s(warehouse))
                out[name] = {who: (b - a) / iters * 1e6
                             for who, a, b in zip(("client", "controller", "warehouse"), before, after, strict=True)}
    return out


async def _raw_round_trip(iters: int, served_by_loop: bool = False) -> dict[str, float]:
    """µs of CPU per round trip to an echo server: {"client", "server"}. The client is a
    ``zmq.asyncio`` DEALER, or (``served_by_loop``) a plain one served by the loop as the dock
    client's sockets are (``streamrl.loop_socket.LoopSocket``)."""
    with tempfile.TemporaryDirectory(prefix="streamrl-bench-") as d:
        endpoint = f"ipc://{d}/echo"
        server = subprocess.Popen([sys.executable, "-c", _ECHO_SERVER, endpoint], stdout=subprocess.PIPE, text=True)
        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.DEALER, socket_class=zmq.Socket) if served_by_loop else ctx.socket(zmq.DEALER)
        link = LoopSocket(sock, copy=True) if served_by_loop else None
        payload = b"x" * 64

        async def round_trip() -> None:
            if link is not None:
                link.send([payload])
                await link.recv()
            else:
                await sock.send(payload)
                await sock.recv()

        try:
            assert server.stdout is not None and server.stdout.readline().strip() == "ready"
            sock.connect(endpoint)
            for _ in range(WARMUP):
                await round_trip()
            before = (_cpu_s(), _cpu_s(server.pid))
            for _ in range(iters):
                await round_trip()
            after = (_cpu_s(), _cpu_s(server.pid))
        finally:
            if link is not None:
                link.close(linger=0)
            sock.close(linger=0)
            server.kill()
            server.wait(timeout=10)
    return {who: (b - a) / iters * 1e6 for who, a, b in zip(("client", "server"), before, after, strict=True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--iters", type=int, default=1000, help="operations of each kind per repetition")
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} at the start", file=sys.stderr)
    dock_runs: list[dict[str, dict[str, float]]] = []
    raw_runs: list[dict[str, float]] = []
    loop_runs: list[dict[str, float]] = []
    for rep in range(args.reps):  # alternating: the host's speed drifts (§27)
        dock_runs.append(anyio.run(_dock_ops, args.iters, backend="asyncio", backend_options=backend_options()))
        raw_runs.append(anyio.run(_raw_round_trip, args.iters, backend="asyncio", backend_options=backend_options()))
        loop_runs.append(anyio.run(_raw_round_trip, args.iters, True, backend="asyncio",
                                   backend_options=backend_options()))
        print(f"repetition {rep + 1}/{args.reps} done (load average {os.getloadavg()[0]:.2f})", file=sys.stderr)

    figures: dict[str, Any] = {}
    rows = []
    for op in OPS:
        cells = [op]
        for who in ("client", "controller", "warehouse"):
            s = spread(r[op][who] for r in dock_runs)
            figures[f"{op}_{who}_us"] = s
            cells.append(fmt_spread(s, 0))
        rows.append(cells)
    mean_client = [statistics.fmean(r[op]["client"] for op in OPS) for r in dock_runs]
    figures["client_mean_us"] = spread(mean_client)
    baseline = {"raw_client_us": spread(r["client"] for r in raw_runs),
                "raw_server_us": spread(r["server"] for r in raw_runs),
                "loop_socket_client_us": spread(r["client"] for r in loop_runs),
                "loop_socket_server_us": spread(r["server"] for r in loop_runs)}
    rows.append(["raw round trip (zmq.asyncio)", fmt_spread(baseline["raw_client_us"], 0),
                 fmt_spread(baseline["raw_server_us"], 0), "-"])
    rows.append(["raw round trip (LoopSocket)", fmt_spread(baseline["loop_socket_client_us"], 0),
                 fmt_spread(baseline["loop_socket_server_us"], 0), "-"])
    print_table(["µs of CPU per operation", "client", "controller (raw: echo server)", "warehouse"], rows)
    ratio = figures["client_mean_us"]["median"] / baseline["raw_client_us"]["median"]
    over_loop = figures["client_mean_us"]["median"] / baseline["loop_socket_client_us"]["median"]
    print(f"the client's mean CPU per operation ÷ a raw zmq.asyncio round trip's: {ratio:.2f} "
          f"(÷ the same round trip on a LoopSocket: {over_loop:.2f})")
    print_json_line("dock_op_cpu", figures, baseline, {"client_per_op_over_raw_round_trip": ratio,
                                                       "client_per_op_over_loop_socket_round_trip": over_loop}, {},
                    reps=args.reps, iters=args.iters)


if __name__ == "__main__":
    main()
