#!/usr/bin/env python3
"""Does one dock controller keep up with a large GRPO cluster? (docs/scaling.md)

Drives one controller (and 2 warehouses) with the sample traffic of a GRPO pipeline: a source
adds groups of 16 samples at a paced rate, and five consumer stages (generate, score, reference,
advantage with whole groups, train) each claim micro-batches of 8, write their column (a small
value: the controller never sees values, and bytes are the warehouses' business, §3 of
docs/benchmarks.md) and ack. Rates:

- the 384-device 32B cluster of docs/scaling.md: 8,192 samples per 300 s step = 27.3 samples/s,
  then 10x, 30x and 100x that (open loop: the source adds on a clock, whatever the stages do);
- the ceiling: the source adds as fast as the dock's capacity lets it (closed loop), which gives
  the most samples/s this machine moves through the whole pipeline, and the controller's CPU per
  sample over its five stages (what docs/scaling.md projects the single controller's limit from).

Baseline, side by side in the same run: the same client processes and tasks making the same
number of controller round trips per sample against dock.py's raw pyzmq ROUTER, which echoes at
once (the transport's floor for this request count, no dock logic).

"Keeps up" at a rate: the train stage acked >= 95% of the samples added, within 2 s of the last
add, and the add->train p99 stays under 1 s. All clients share the 2 cores with the controller,
so the ceiling is a lower bound for the controller alone; the controller's CPU per sample is
measured from /proc.

    python ops/bench/controller_load.py                  # ~2 min
    python ops/bench/controller_load.py --seconds 5 --reps 1

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ops.bench._common import fmt_spread, percentile, print_json_line, print_table, spread
from ops.bench.dock import RawServer, _cpu_seconds
from streamrl.dock.client import DockClient
from streamrl.dock.controller import ConsumerView
from streamrl.dock.errors import DockTimeout, EndOfStream
from streamrl.dock.launch import LocalDock

CLUSTER_RATE = 8192 / 300.0  # samples/s: 512 prompts x 16 per ~300 s step (docs/scaling.md)
MULTIPLIERS = (1, 10, 30, 100)
GROUP, MICRO = 16, 8
TASKS_PER_STAGE = 4
# (consumer, reads, writes, whole_groups); the source writes "prompt"
STAGES: list[tuple[str, list[str], str | None, bool]] = [
    ("generate", ["prompt"], "response", False),
    ("score", ["prompt", "response"], "reward", False),
    ("reference", ["prompt", "response"], "ref_logprob", False),
    ("advantage", ["reward"], "advantage", True),
    ("train", ["prompt", "response", "ref_logprob", "advantage"], None, False),
]
# which client process runs which stages (the source runs in process 0)
PROCESS_STAGES = (("generate", "score"), ("reference", "advantage", "train"))
KEEP_UP_FRACTION, KEEP_UP_DRAIN_S, KEEP_UP_P99_S = 0.95, 2.0, 1.0


# ------------------------------------------------------------------ the dock side
async def _stage_task(endpoint: str, consumer: str, reads: list[str], writes: str | None, whole: bool,
                      acked: dict[int, float]) -> None:
    async with DockClient(endpoint, request_timeout_s=30.0) as dock:
        while True:
            try:
                lease = await dock.claim(consumer, reads, MICRO, whole_groups=whole, timeout=0.5)
            except DockTimeout:
                continue
            except EndOfStream:
                return
            indices = lease.indices
            if writes is not None:
                await dock.put(indices, {writes: [0] * len(indices)})
            await dock.ack(lease)
            if consumer == "train":
                now = time.monotonic()
                for k in indices:
                    acked[k] = now


async def _source(endpoint: str, rate: float | None, seconds: float, added: dict[int, float]) -> None:
    """Adds groups on a clock (``rate`` samples/s), or as fast as capacity lets (``None``)."""
    async with DockClient(endpoint, request_timeout_s=60.0) as dock:
        start = time.monotonic()
        k = 0
        while time.monotonic() - start < seconds:
            if rate is not None:
                due = start + k * GROUP / rate
                if (wait := due - time.monotonic()) > 0:
                    await asyncio.sleep(wait)
            indices = await dock.add({"prompt": [0] * GROUP}, group_size=GROUP)
            now = time.monotonic()
            for i in indices:
                added[i] = now
            k += 1
        await dock.close_input()


def _dock_process(conn: Connection, endpoint: str, stages: tuple[str, ...], source: bool, rate: float | None,
                  seconds: float) -> None:
    added: dict[int, float] = {}
    acked: dict[int, float] = {}

    async def main() -> None:
        conn.recv()  # go
        jobs = [_stage_task(endpoint, c, r, w, g, acked) for c, r, w, g in STAGES if c in stages
                for _ in range(TASKS_PER_STAGE)]
        if source:
            jobs.append(_source(endpoint, rate, seconds, added))
        await asyncio.wait_for(asyncio.gather(*jobs), timeout=seconds + 120)

    try:
        asyncio.run(main())
        conn.send({"added": added, "acked": acked})
    except BaseException as exc:  # the parent reports it
        conn.send({"error": f"{type(exc).__name__}: {exc}"})


def run_dock(rate: float | None, seconds: float, capacity: int) -> dict[str, Any]:
    views = {c: ConsumerView(r, g) for c, r, _, g in STAGES}
    with LocalDock([c for c, *_ in STAGES], capacity=capacity, n_warehouses=2, transport="tcp",
                   views=views) as dock:
        ctl = dock.pids[0]
        ctx = mp.get_context("spawn")
        pipes, procs = [], []
        for k, stages in enumerate(PROCESS_STAGES):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_dock_process,
                               args=(child, dock.controller_endpoint, stages, k == 0, rate, seconds))
            proc.start()
            pipes.append(parent)
            procs.append(proc)
        time.sleep(2.0)  # imports and connections before the clock starts
        cpu0, t0 = _cpu_seconds(ctl), time.monotonic()
        for pipe in pipes:
            pipe.send("go")
        results = []
        for pipe in pipes:
            if not pipe.poll(seconds + 150):
                raise TimeoutError("a client process did not finish")
            results.append(pipe.recv())
        t1, cpu = time.monotonic(), _cpu_seconds(ctl) - cpu0
        for proc in procs:
            proc.join(10)
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise RuntimeError(f"client process failed: {errors}")
    added = {k: v for r in results for k, v in r["added"].items()}
    acked = {k: v for r in results for k, v in r["acked"].items()}
    lat = sorted(acked[k] - added[k] for k in acked if k in added)
    last_add, last_ack = max(added.values()), max(acked.values(), default=math.inf)
    span = max(last_ack, last_add) - min(added.values())
    return {
        "added": len(added), "trained": len(acked),
        # what the clock asked the source to add (a source that fell behind did not keep up either)
        "due": rate * seconds if rate is not None else len(added),
        "samples_per_s": len(acked) / span if span > 0 else 0.0,
        "p50_s": percentile(lat, 0.5) if lat else math.inf, "p99_s": percentile(lat, 0.99) if lat else math.inf,
        "drain_s": last_ack - last_add,
        "controller_cpu_share": cpu / (t1 - t0),
        "controller_us_per_sample": cpu / max(1, len(acked)) * 1e6,
    }


def keeps_up(r: dict[str, Any]) -> bool:
    return (r["added"] >= KEEP_UP_FRACTION * r["due"] and r["trained"] >= KEEP_UP_FRACTION * r["added"]
            and r["drain_s"] <= KEEP_UP_DRAIN_S and r["p99_s"] <= KEEP_UP_P99_S)


# ------------------------------------------------------------------ the raw pyzmq floor
# Controller round trips a sample makes, per the dock protocol: per micro-batch of 8 and stage a
# claim and an ack (5 stages), per group of 16 a reserve; the puts go to warehouses, which each
# send the controller one columns_ready (one-way) per put: counted as a round trip here.
ROUND_TRIPS_PER_SAMPLE = (2 * len(STAGES) + len(STAGES)) / MICRO + 1 / GROUP


def _raw_process(conn: Connection, endpoint: str, tasks: int, round_trips: int) -> None:
    async def task(ctx: zmq.asyncio.Context, n: int) -> None:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        body = b"x" * 96  # about a claim's size
        try:
            for _ in range(n):
                await sock.send_multipart([b"echo", body])  # dock.py's RawServer answers [op, reply]
                await sock.recv_multipart()
        finally:
            sock.close(linger=0)

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        conn.recv()
        t0 = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*[task(ctx, round_trips // tasks) for _ in range(tasks)]), 300)
        conn.send(time.monotonic() - t0)
        ctx.term()

    asyncio.run(main())


def run_raw(samples: int) -> dict[str, Any]:
    """The same request count as ``samples`` through the pipeline, in the same process layout."""
    ctx = mp.get_context("spawn")
    ipc_dir = tempfile.mkdtemp(prefix="srl-ctlbench-")
    server = RawServer("controller", ipc_dir)
    try:
        endpoint = server.endpoints["tcp"]
        trips = int(samples * ROUND_TRIPS_PER_SAMPLE)
        tasks = TASKS_PER_STAGE * len(STAGES) // len(PROCESS_STAGES)
        pipes, procs = [], []
        for _ in PROCESS_STAGES:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_raw_process, args=(child, endpoint, tasks, trips // len(PROCESS_STAGES)))
            proc.start()
            pipes.append(parent)
            procs.append(proc)
        time.sleep(1.0)
        cpu0 = _cpu_seconds(server.pid)
        for pipe in pipes:
            pipe.send("go")
        seconds = max(pipe.recv() for pipe in pipes)
        cpu = _cpu_seconds(server.pid) - cpu0
        for proc in procs:
            proc.join(10)
    finally:
        server.stop()
        shutil.rmtree(ipc_dir, ignore_errors=True)
    return {"samples_per_s": samples / seconds, "server_us_per_sample": cpu / samples * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=8.0, help="source duration of each paced run")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    capacity = 4096  # live samples: the dock's backpressure bounds the closed-loop run
    load0 = os.getloadavg()[0]
    paced: dict[int, list[dict[str, Any]]] = {m: [] for m in MULTIPLIERS}
    ceiling: list[dict[str, Any]] = []
    raw: list[dict[str, Any]] = []
    for rep in range(args.reps):
        for m in MULTIPLIERS:
            paced[m].append(run_dock(CLUSTER_RATE * m, args.seconds, capacity))
        ceiling.append(run_dock(None, args.seconds, capacity))
        raw.append(run_raw(max(1000, ceiling[-1]["trained"])))
        print(f"repetition {rep + 1}/{args.reps} done (load {os.getloadavg()[0]:.1f})", flush=True)

    rows = []
    figures: dict[str, Any] = {}
    for m in MULTIPLIERS:
        runs = paced[m]
        ok = all(keeps_up(r) for r in runs)
        figures[f"x{m}"] = {"target_samples_per_s": CLUSTER_RATE * m,
                            "samples_per_s": spread(r["samples_per_s"] for r in runs),
                            "p99_s": spread(r["p99_s"] for r in runs),
                            "controller_cpu_share": spread(r["controller_cpu_share"] for r in runs),
                            "keeps_up": ok}
        rows.append([f"{m}x cluster ({CLUSTER_RATE * m:,.0f}/s)", fmt_spread(figures[f"x{m}"]["samples_per_s"], 1),
                     f"{spread(r['p50_s'] for r in runs)['median'] * 1e3:.1f}",
                     f"{figures[f'x{m}']['p99_s']['median'] * 1e3:.1f}",
                     f"{figures[f'x{m}']['controller_cpu_share']['median']:.3f}", "yes" if ok else "NO"])
    figures["ceiling"] = {k: spread(r[k] for r in ceiling)
                          for k in ("samples_per_s", "controller_us_per_sample", "controller_cpu_share")}
    rows.append(["ceiling (closed loop)", fmt_spread(figures["ceiling"]["samples_per_s"], 0),
                 f"{spread(r['p50_s'] for r in ceiling)['median'] * 1e3:.0f}",
                 f"{spread(r['p99_s'] for r in ceiling)['median'] * 1e3:.0f}",
                 f"{figures['ceiling']['controller_cpu_share']['median']:.3f}", "-"])
    print_table(["rate", "trained samples/s", "add->train p50 ms", "p99 ms", "controller CPU share", "keeps up"], rows)
    us = figures["ceiling"]["controller_us_per_sample"]
    baseline = {"raw_samples_per_s": spread(r["samples_per_s"] for r in raw),
                "raw_server_us_per_sample": spread(r["server_us_per_sample"] for r in raw)}
    controller_limit = 1e6 / us["median"]
    print(f"controller CPU per sample (5 stages): {fmt_spread(us, 1)} us -> one controller core alone: "
          f"~{controller_limit:,.0f} samples/s = {controller_limit / CLUSTER_RATE:,.0f}x the cluster's rate")
    print(f"raw pyzmq, same round trips per sample ({ROUND_TRIPS_PER_SAMPLE:.3f}): "
          f"{fmt_spread(baseline['raw_samples_per_s'], 0)} samples/s, "
          f"server {fmt_spread(baseline['raw_server_us_per_sample'], 1)} us/sample")
    ratios = {"ceiling_over_raw": figures["ceiling"]["samples_per_s"]["median"]
              / baseline["raw_samples_per_s"]["median"],
              "controller_limit_over_cluster_rate": controller_limit / CLUSTER_RATE}
    print_json_line("controller_load", figures, baseline, ratios,
                    {"keeps_up_at_cluster_rate": True, "controller_limit_over_cluster_rate": ">= 10"},
                    reps=args.reps, seconds=args.seconds, load=[load0, os.getloadavg()[0]])


if __name__ == "__main__":
    main()
