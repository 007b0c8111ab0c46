"""Transfer-dock benchmark: data-plane bandwidth, claim throughput, and claim latency at 384 consumers.

Every figure is measured side by side with a raw pyzmq baseline in the same run, repetitions
interleaved (raw, dock, raw, dock, ...) so machine noise hits both sides alike. Servers (dock
controller/warehouse, raw ROUTERs) and client workers are separate processes.

1. **Bandwidth** (per payload size, tcp loopback and ipc). One iteration moves the payload to
   a server and back, in two request/reply round trips, on every side:

   * raw (the baseline): a sync pyzmq DEALER (this process) and a ROUTER in another process.
     ``send_multipart([b"put", payload], copy=False)``; the server keeps the received frame (no
     copy) and answers ``[b"ok"]``. Then ``[b"get"]``; the server answers ``[b"data", frame]``
     with ``copy=False``; the client views it with ``torch.frombuffer``.
   * raw asyncio (reference): the same from a ``zmq.asyncio`` DEALER, the dock client's I/O model.
   * dock: ``DockClient.put([i], {"x": [t]})`` then ``DockClient.fetch([i], ["x"])`` against a
     ``LocalDock`` warehouse (msgspec headers, zero-copy frames, the warehouse also tells the
     controller the column is ready before answering). Untimed per iteration: ``reserve`` before
     and ``claim`` + ``ack`` after, so the warehouse frees the sample and memory stays flat.

   MB/s = 2 x payload bytes x iterations / summed time of the timed part (10^6 bytes per MB).

2. **Claims** (consumer ``train``, micro-batches of 8, samples preloaded before the clock starts;
   every task makes exactly its share of claims, so nothing is left over):

   * end to end: ``claim_procs x claim_clients`` DockClients (one task each) loop
     ``claim_nowait(8)`` + ``ack``. Baseline: the same processes, clients and tasks on raw
     ``zmq.asyncio`` DEALERs sending the same encoded Claim and Ack headers to an echo ROUTER
     that answers each with a Claimed-sized reply: the messaging ceiling of that client layout.
   * controller-bound: ``claim_procs`` sync DEALERs speaking the dock protocol directly, each
     keeping ``--pipe-depth`` claims in flight and acking every lease at once (no event loop, a
     few microseconds of Python per message), so the controller is what limits the rate.
     Baseline: the same generator against the echo ROUTER.
   * claim -> fetch latency: one client, unloaded, ``claim_nowait(8)`` then ``fetch`` of the 8
     samples' ``tokens`` (int64[256] each, 16 KiB in all) timed together, ack untimed. Baseline:
     an echo round trip to one raw server then a get of a stored 16 KiB frame from another.

   Sample-claims/s = samples / (last end - first start) over all tasks (CLOCK_MONOTONIC, shared
   by the processes). Server CPU comes from /proc: CPU per claim+ack says what one controller
   could serve with a whole core.

3. **Scale**: ``scale_procs x scale_clients`` DockClients (default 4 x 96 = 384, each its own
   sockets and task); process ``k`` claims as consumer ``c{k % scale_consumers}`` (default 4
   consumer names, i.e. 4 stages of 96 workers; every sample is claimed once per name). Each
   worker loops: ``claim_nowait(8)``, hold the lease for a think time (uniform 0.5-1.5 x
   ``--scale-think-ms``, standing in for the stage's compute), ``ack``. Reported: the round trip
   of claims that returned samples as the 384 workers see it (p50/p99 over all of them), and as a
   light sync *probe* process sees it, claiming (then releasing) as ``c0`` every ``--probe-ms``
   during the run: the controller's latency under that load without the queueing inside
   96-client event loops. Baseline: the same layout, pacing and probe on raw ``zmq.asyncio``
   DEALERs against an echo ROUTER.

4. **Security** (``--security``, ``--curve``, or ``security`` in ``--phases``): the dock's tcp figures
   three ways in the same run, repetitions interleaved (the side order rotates every repetition):
   *plaintext* (no authentication), *auth-only* (ZAP PLAIN, what ``processes`` and ``inprocess``
   runs use) and *CURVE* (``ray``'s default). Put+fetch MB/s at 4 MiB and 64 MiB (as in 1, dock
   side only) and sample-claims/s, end to end and controller-bound (as in 2). Three ``LocalDock``
   instances over tcp, two started with fresh :class:`streamrl.security.RunCredentials`, whose
   clients present role ``stage:bench``'s. CURVE variants, bandwidth only: the warehouse's and the
   client's zmq context with 2 I/O threads (``curve_io2``), and that with two DockClients moving
   the payloads in parallel, two connections (``curve_io2_2conn``). Reported: each side's median
   [min, max] and its ratio to plaintext (the median of the per-repetition ratios); targets: auth-only >= 0.95 of plaintext's
   4 MiB bandwidth and >= 0.90 of its claim rates.

On a machine of few cores shared with other work every figure is noisy and the client processes
compete with the servers for CPU: the table prints CPU shares and run-queue waits so a reader can
tell load from design. Run: ``python ops/bench/dock.py`` (about 3 minutes),
``--quick`` (about 1 minute), ``--reps N``, ``--phases bandwidth,claims,scale``. The last output line
is one JSON object: name, figures, baseline, ratio, target.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing as mp
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import anyio
import torch
import zmq
import zmq.asyncio

from streamrl.dock import protocol as p
from streamrl.dock.client import DockClient
from streamrl.dock.errors import NothingToClaim
from streamrl.dock.launch import LocalDock, Transport
from streamrl.security import CLIENT_ENV, ClientAuth, RunCredentials, secure_client

try:
    from ops.bench._common import fmt_spread, percentile, print_json_line, print_table, spread
except ImportError:  # run as a script: ops/ is not a package
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import fmt_spread, percentile, print_json_line, print_table, spread

MB = 1e6
SIZES = {"4KiB": 4 << 10, "256KiB": 256 << 10, "4MiB": 4 << 20, "64MiB": 64 << 20}
BYTES_PER_MEASURE = 128 << 20  # each bandwidth measurement moves about this much (capped in iterations)
MICRO_BATCH = 8  # samples per claim, as the brief asks
TOKENS_PER_SAMPLE = 256  # the preloaded ``tokens`` column: int64[256] = 2 KiB per sample
JOB_TIMEOUT_S = 120.0  # no single worker job may take longer than this
READY_TIMEOUT_S = 90.0  # worker setup (imports, 96 clients connecting) on a loaded 2-core machine
TARGETS = {"bandwidth_ratio_min": 0.8, "claim_samples_per_s_min": 50_000.0, "scale_p99_ms_max": 10.0}


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, from /proc (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _sched_wait(pid: int) -> tuple[float, int]:
    """Seconds the process's threads waited on a run queue, and their number of runs (schedstat)."""
    wait, runs = 0, 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError):
            _, w, n = (int(x) for x in (task / "schedstat").read_text().split())
            wait += w
            runs += n
    return wait / 1e9, runs


# ====================================================================== raw pyzmq server (baseline)
ECHO_REPLY = b"\x00" * 160  # about the size of an encoded Claimed reply with 8 samples


def _raw_server_main(conn: Connection, endpoints: list[str]) -> None:
    """A sync ROUTER: ``put`` keeps the frame (per peer), ``get`` sends it back, ``echo`` answers.

    Stops when anything (or EOF: the parent died) arrives on ``conn``.
    """
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    bound = []
    for ep in endpoints:
        sock.bind(ep)
        bound.append(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    conn.send_bytes(_dumps(bound))
    stored: dict[bytes, zmq.Frame] = {}
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(conn.fileno(), zmq.POLLIN)
    try:
        while True:
            events = dict(poller.poll(1000))
            if conn.fileno() in events:
                return
            if sock not in events:
                continue
            for _ in range(1000):
                try:
                    frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                ident, op = frames[0].bytes, frames[1].bytes
                if op == b"put":
                    stored[ident] = frames[2]
                    sock.send_multipart([ident, b"ok"])
                elif op == b"get":
                    sock.send_multipart([ident, b"data", stored[ident]], copy=False)
                else:  # echo: the op comes back so a pipelining client can tell replies apart
                    sock.send_multipart([ident, op, ECHO_REPLY])
    finally:
        sock.close(linger=0)
        ctx.term()


class RawServer:
    """A raw pyzmq server process bound on tcp loopback and on ipc in ``ipc_dir``."""

    def __init__(self, name: str, ipc_dir: str) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_raw_server_main, args=(child, ["tcp://127.0.0.1:0", f"ipc://{ipc_dir}/{name}"]),
            name=f"dockbench-raw-{name}", daemon=True,
        )
        self.proc.start()
        child.close()
        if not self._conn.poll(READY_TIMEOUT_S):
            self.stop()
            raise RuntimeError(f"raw server {name} did not start within {READY_TIMEOUT_S} s")
        tcp, ipc = json.loads(self._conn.recv_bytes())
        self.endpoints = {"tcp": tcp, "ipc": ipc}

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.send_bytes(b"stop")
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self._conn.close()


# ====================================================================== client workers
class RawAsyncClient:
    """Baseline client: raw zmq.asyncio DEALERs, one request in flight per socket, no routing."""

    def __init__(self, ctx: zmq.asyncio.Context, ctl: str, data: str | None = None) -> None:
        self.ctl = ctx.socket(zmq.DEALER)
        self.ctl.setsockopt(zmq.LINGER, 0)
        self.ctl.connect(ctl)
        self.data = None
        if data is not None:
            self.data = ctx.socket(zmq.DEALER)
            self.data.setsockopt(zmq.LINGER, 0)
            self.data.connect(data)

    async def call(self, sock: zmq.asyncio.Socket, frames: Sequence[Any]) -> list[zmq.Frame]:
        await sock.send_multipart(frames, copy=False)
        return await sock.recv_multipart(copy=False)

    def close(self) -> None:
        for s in (self.ctl, self.data):
            if s is not None:
                s.close(linger=0)


async def _wait_go(conn: Connection) -> None:
    conn.send_bytes(_dumps({"ready": True}))
    if not await anyio.to_thread.run_sync(conn.poll, READY_TIMEOUT_S):
        raise TimeoutError("no go signal from the benchmark driver")
    if json.loads(conn.recv_bytes()).get("go") is not True:
        raise RuntimeError("expected the go signal")


async def _claim_loop_job(conn: Connection, job: dict[str, Any]) -> dict[str, Any]:
    """``n_clients`` clients, one task each, making ``claims_per_task`` claims of 8 (+ ack)."""
    system, n_clients, per_task = job["system"], job["n_clients"], job["claims_per_task"]
    think_s, consumer = job["think_s"], job["consumer"]
    rng = random.Random(job["seed"])
    lat: list[float] = []
    spans: list[tuple[float, float]] = []
    empty = 0
    samples = 0
    claim_hdr = p.encoder.encode(p.Claim(1, "raw", consumer, ["tokens"], MICRO_BATCH))
    ack_hdr = p.encoder.encode(p.Ack(2, "raw", 1))

    async def dock_task(c: DockClient) -> None:
        nonlocal empty, samples
        if think_s:
            await anyio.sleep(rng.uniform(0, think_s))  # stagger: workers do not start in lockstep
        start = time.monotonic()
        done = 0
        while done < per_task:
            t0 = time.perf_counter()
            try:
                lease = await c.claim_nowait(consumer, ["tokens"], MICRO_BATCH)
            except NothingToClaim:
                empty += 1  # readiness not at the controller yet; excluded from the latency
                await anyio.sleep(0.001)
                continue
            lat.append(time.perf_counter() - t0)
            if think_s:
                await anyio.sleep(think_s * rng.uniform(0.5, 1.5))
            await c.ack(lease)
            samples += len(lease)
            done += 1
        spans.append((start, time.monotonic()))

    async def raw_task(c: RawAsyncClient) -> None:
        nonlocal samples
        if think_s:
            await anyio.sleep(rng.uniform(0, think_s))
        start = time.monotonic()
        for _ in range(per_task):
            t0 = time.perf_counter()
            await c.call(c.ctl, [b"echo", claim_hdr])
            lat.append(time.perf_counter() - t0)
            if think_s:
                await anyio.sleep(think_s * rng.uniform(0.5, 1.5))
            await c.call(c.ctl, [b"echo", ack_hdr])
            samples += MICRO_BATCH
        spans.append((start, time.monotonic()))

    async with contextlib.AsyncExitStack() as stack:
        if system == "dock":
            auth = _job_auth(job)
            clients: list[Any] = [
                await stack.enter_async_context(DockClient(job["endpoint"], request_timeout_s=30.0, auth=auth))
                for _ in range(n_clients)
            ]
            task: Callable[[Any], Any] = dock_task
        else:
            ctx = zmq.asyncio.Context()
            stack.callback(ctx.term)
            clients = [RawAsyncClient(ctx, job["endpoint"]) for _ in range(n_clients)]
            for c in clients:
                stack.callback(c.close)
            task = raw_task
        if system == "raw":
            # connect before the clock starts, as DockClient does with its Hello: hundreds of
            # simultaneous first connects overflow the listen backlog and cost a 1 s SYN retry
            with anyio.fail_after(READY_TIMEOUT_S):
                for c in clients:
                    await c.call(c.ctl, [b"connect", b""])
        await _wait_go(conn)
        cpu0 = time.process_time()
        with anyio.fail_after(JOB_TIMEOUT_S):
            async with anyio.create_task_group() as tg:
                for c in clients:
                    tg.start_soon(task, c)
        cpu = time.process_time() - cpu0
    return {"spans": spans, "lat": lat, "empty": empty, "samples": samples, "client_cpu_s": cpu}


async def _claim_fetch_job(conn: Connection, job: dict[str, Any]) -> dict[str, Any]:
    """One client: claim 8 then fetch their tokens, timed together; ack untimed."""
    lat: list[float] = []
    empty = 0
    iters = job["iters"]
    await _wait_go(conn)
    with anyio.fail_after(JOB_TIMEOUT_S):
        if job["system"] == "dock":
            async with DockClient(job["endpoint"], request_timeout_s=30.0) as c:
                while len(lat) < iters:
                    t0 = time.perf_counter()
                    try:
                        lease = await c.claim_nowait(job["consumer"], ["tokens"], MICRO_BATCH)
                    except NothingToClaim:
                        empty += 1
                        await anyio.sleep(0.001)
                        continue
                    cols = await c.fetch(lease.indices, ["tokens"])
                    lat.append(time.perf_counter() - t0)
                    assert len(cols["tokens"]) == MICRO_BATCH
                    await c.ack(lease)
        else:
            ctx = zmq.asyncio.Context()
            c = RawAsyncClient(ctx, job["endpoint"], job["data_endpoint"])
            try:
                assert c.data is not None
                batch = torch.zeros(MICRO_BATCH * TOKENS_PER_SAMPLE, dtype=torch.int64)
                await c.call(c.data, [b"put", memoryview(batch.numpy()).cast("B")])
                claim_hdr = p.encoder.encode(p.Claim(1, "raw", job["consumer"], ["tokens"], MICRO_BATCH))
                get_hdr = p.encoder.encode(p.Get(2, list(range(MICRO_BATCH)), ["tokens"]))
                ack_hdr = p.encoder.encode(p.Ack(3, "raw", 1))
                for _ in range(iters):
                    t0 = time.perf_counter()
                    await c.call(c.ctl, [b"echo", claim_hdr])
                    frames = await c.call(c.data, [b"get", get_hdr])
                    torch.frombuffer(frames[1].buffer, dtype=torch.int64)
                    lat.append(time.perf_counter() - t0)
                    await c.call(c.ctl, [b"echo", ack_hdr])
            finally:
                c.close()
                ctx.term()
    return {"lat": lat, "empty": empty}


def _job_auth(job: dict[str, Any]) -> ClientAuth | None:
    """The role credentials a job was handed (the security phase), or None."""
    text = job.get("auth")
    return ClientAuth.from_env({CLIENT_ENV: text}) if text else None


def _sync_dealer(endpoint: str, auth: ClientAuth | None = None) -> tuple[zmq.Context, zmq.Socket]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 30_000)  # every wait has a timeout
    sock.setsockopt(zmq.SNDTIMEO, 30_000)
    secure_client(sock, auth)
    sock.connect(endpoint)
    return ctx, sock


def _sync_hello(sock: zmq.Socket, system: str, client_id: str) -> None:
    """Register with the dock controller (or, raw, one echo): connected before the clock starts."""
    if system == "dock":
        sock.send(p.encoder.encode(p.Hello(0, client_id, p.PROTOCOL_VERSION, 60.0)))
        hello = p.reply_decoder.decode(sock.recv())
        if not isinstance(hello, p.HelloReply):
            raise RuntimeError(f"expected a HelloReply, got {hello!r}")
    else:
        sock.send_multipart([b"connect", b""])
        sock.recv_multipart()


async def _claim_pipe_job(conn: Connection, job: dict[str, Any]) -> dict[str, Any]:
    """Protocol-level load: one sync DEALER keeps ``depth`` claims in flight, acks each lease at once.

    No DockClient and no event loop: a few microseconds of Python per message, so the controller
    (not this client) is what limits the rate. Same messages as DockClient sends.
    """
    system, quota, depth = job["system"], job["claims"], job["depth"]
    client_id = f"pipe-{os.getpid()}"
    ctx, sock = _sync_dealer(job["endpoint"], _job_auth(job))
    empty = 0
    samples = 0
    try:
        _sync_hello(sock, system, client_id)
        claim_raw = p.encoder.encode(p.Claim(1, client_id, job["consumer"], ["tokens"], MICRO_BATCH))
        ack_raw = p.encoder.encode(p.Ack(2, client_id, 1))
        await _wait_go(conn)
        start = time.monotonic()
        deadline = start + JOB_TIMEOUT_S
        rid = 10
        sent = 0  # claims sent that will return samples (quota accounting)
        in_flight = 0
        for _ in range(min(depth, quota)):
            rid += 1
            if system == "dock":
                sock.send(p.encoder.encode(p.Claim(rid, client_id, job["consumer"], ["tokens"], MICRO_BATCH)))
            else:
                sock.send_multipart([b"claim", claim_raw])
            sent += 1
            in_flight += 1
        while in_flight:
            if time.monotonic() > deadline:
                raise TimeoutError("pipelined claims did not finish in time")
            in_flight -= 1
            if system == "dock":
                msg = p.reply_decoder.decode(sock.recv())
                match msg:
                    case p.Claimed(samples=got, lease_id=lid) if got:
                        samples += len(got)
                        rid += 1
                        sock.send(p.encoder.encode(p.Ack(rid, client_id, lid)))
                        in_flight += 1
                        continue
                    case p.Claimed():
                        empty += 1
                        sent -= 1  # retry this one
                    case p.Ok():
                        pass
                    case _:
                        raise RuntimeError(f"unexpected reply {msg!r}")
                if sent < quota:
                    rid += 1
                    sock.send(p.encoder.encode(p.Claim(rid, client_id, job["consumer"], ["tokens"], MICRO_BATCH)))
                    sent += 1
                    in_flight += 1
            else:
                op = sock.recv_multipart()[0]
                if op == b"claim":
                    samples += MICRO_BATCH
                    sock.send_multipart([b"ack", ack_raw])
                    in_flight += 1
                elif sent < quota:
                    sock.send_multipart([b"claim", claim_raw])
                    sent += 1
                    in_flight += 1
        end = time.monotonic()
    finally:
        sock.close(linger=0)
        ctx.term()
    return {"spans": [(start, end)], "lat": [], "empty": empty, "samples": samples}


async def _claim_probe_job(conn: Connection, job: dict[str, Any]) -> dict[str, Any]:
    """A light sync client timing one claim every ``interval_s`` while others load the controller.

    It claims as an existing consumer and *releases* (not acks) each lease, so the samples go back
    to the front of that consumer's queue and the loaded workers' accounting stays exact. Its
    round trips show the controller's latency without the event-loop queueing of 96-client processes.
    """
    system = job["system"]
    client_id = f"probe-{os.getpid()}"
    ctx, sock = _sync_dealer(job["endpoint"])
    lat: list[float] = []
    empty = 0
    try:
        _sync_hello(sock, system, client_id)
        claim_raw = p.encoder.encode(p.Claim(1, client_id, job["consumer"], ["tokens"], MICRO_BATCH))
        await _wait_go(conn)
        start = time.monotonic()
        nxt = start
        rid = 10
        while time.monotonic() < start + job["duration_s"]:
            nxt += job["interval_s"]
            rid += 1
            t0 = time.perf_counter()
            if system == "dock":
                sock.send(p.encoder.encode(p.Claim(rid, client_id, job["consumer"], ["tokens"], MICRO_BATCH)))
                msg = p.reply_decoder.decode(sock.recv())
                dt = time.perf_counter() - t0
                if not isinstance(msg, p.Claimed):
                    raise RuntimeError(f"unexpected reply {msg!r}")
                if msg.samples:
                    lat.append(dt)
                    rid += 1
                    sock.send(p.encoder.encode(p.Release(rid, client_id, msg.lease_id)))
                    assert isinstance(p.reply_decoder.decode(sock.recv()), p.Ok)
                else:
                    empty += 1
            else:
                sock.send_multipart([b"claim", claim_raw])
                sock.recv_multipart()
                lat.append(time.perf_counter() - t0)
                sock.send_multipart([b"release", claim_raw])
                sock.recv_multipart()
            time.sleep(max(0.0, nxt - time.monotonic()))
        end = time.monotonic()
    finally:
        sock.close(linger=0)
        ctx.term()
    return {"spans": [(start, end)], "lat": lat, "empty": empty, "samples": 0, "client_cpu_s": 0.0}


async def _run_job(conn: Connection, job: dict[str, Any]) -> dict[str, Any]:
    match job["kind"]:
        case "claim_probe":
            return await _claim_probe_job(conn, job)
        case "claim_pipe":
            return await _claim_pipe_job(conn, job)
        case "claim_loop":
            return await _claim_loop_job(conn, job)
        case "claim_fetch":
            return await _claim_fetch_job(conn, job)
    raise ValueError(f"unknown job kind {job['kind']!r}")


def _worker_main(conn: Connection) -> None:
    """A benchmark worker process: runs jobs sent as JSON until told to stop (or the parent goes)."""
    try:
        while conn.poll(600):
            job = json.loads(conn.recv_bytes())
            if job["kind"] == "stop":
                return
            try:
                result = asyncio.run(_run_job(conn, job))
            except BaseException:
                result = {"error": traceback.format_exc()}
            conn.send_bytes(_dumps(result))
    except (EOFError, OSError):
        return


class WorkerPool:
    """``n`` spawned worker processes; ``run`` gives each a job, starts them together, gathers results."""

    def __init__(self, n: int) -> None:
        ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        try:
            for k in range(n):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_worker_main, args=(child,), name=f"dockbench-worker-{k}", daemon=True)
                proc.start()
                child.close()
                self.procs.append(proc)
                self.conns.append(parent)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _recv(conn: Connection, timeout: float) -> dict[str, Any]:
        if not conn.poll(timeout):
            raise TimeoutError(f"benchmark worker silent for {timeout} s")
        msg = json.loads(conn.recv_bytes())
        if "error" in msg:
            raise RuntimeError(f"benchmark worker failed:\n{msg['error']}")
        return msg

    def run(self, jobs: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], float, float]:
        """Run one job per worker (the first ``len(jobs)`` workers), all released at the same moment.

        Returns the results and the wall-clock start and end seen by the driver.
        """
        conns = self.conns[: len(jobs)]
        for conn, job in zip(conns, jobs, strict=True):
            conn.send_bytes(_dumps(job))
        for conn in conns:
            self._recv(conn, READY_TIMEOUT_S)
        t0 = time.monotonic()
        for conn in conns:
            conn.send_bytes(_dumps({"go": True}))
        results = [self._recv(conn, JOB_TIMEOUT_S + 30) for conn in conns]
        return results, t0, time.monotonic()

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(_dumps({"kind": "stop"}))
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self.conns:
            conn.close()
        self.procs.clear()
        self.conns.clear()


# ====================================================================== 1. bandwidth
def _raw_put_fetch(sock: zmq.Socket, payload: torch.Tensor, check: bool = False) -> float:
    t0 = time.perf_counter()
    sock.send_multipart([b"put", memoryview(payload.numpy())], copy=False)
    sock.recv_multipart()
    sock.send_multipart([b"get"])
    frames = sock.recv_multipart(copy=False)
    out = torch.frombuffer(frames[1].buffer, dtype=torch.uint8)
    dt = time.perf_counter() - t0
    if check and not torch.equal(out, payload):
        raise AssertionError("raw baseline returned different bytes")
    return dt


async def _araw_put_fetch(sock: zmq.asyncio.Socket, payload: torch.Tensor, check: bool = False) -> float:
    """The raw round trips again, from a zmq.asyncio socket (the dock client's I/O model)."""
    t0 = time.perf_counter()  # the socket's RCVTIMEO/SNDTIMEO bound every wait (pyzmq honours them in asyncio)
    await sock.send_multipart([b"put", memoryview(payload.numpy())], copy=False)
    await sock.recv_multipart()
    await sock.send_multipart([b"get"])
    frames = await sock.recv_multipart(copy=False)
    out = torch.frombuffer(frames[1].buffer, dtype=torch.uint8)
    dt = time.perf_counter() - t0
    if check and not torch.equal(out, payload):
        raise AssertionError("raw asyncio baseline returned different bytes")
    return dt


async def _dock_put_fetch(dock: DockClient, payload: torch.Tensor, check: bool = False) -> float:
    [i] = await dock.reserve(1)
    t0 = time.perf_counter()
    await dock.put([i], {"x": [payload]})
    out = await dock.fetch([i], ["x"])
    dt = time.perf_counter() - t0
    if check and not torch.equal(out["x"][0], payload):
        raise AssertionError("dock returned different bytes")
    del out
    lease = await dock.claim("bench", ["x"], 1, timeout=30)  # untimed: frees the sample on the warehouse
    await dock.ack(lease)
    return dt


async def bench_bandwidth(
    transport: Transport, raw_endpoint: str, reps: int, sizes: dict[str, int], scale: float
) -> dict[str, dict[str, list[float]]]:
    """MB/s per size, per rep, for raw (sync), raw (asyncio) and dock on one transport."""
    systems = ("raw", "araw", "dock")
    out: dict[str, dict[str, list[float]]] = {name: {k: [] for k in sizes} for name in systems}
    zctx = zmq.Context()
    actx = zmq.asyncio.Context()
    sock = zctx.socket(zmq.DEALER)
    asock = actx.socket(zmq.DEALER)
    for s in (sock, asock):
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 60_000)  # every wait has a timeout
        s.setsockopt(zmq.SNDTIMEO, 60_000)
        s.connect(raw_endpoint)
    try:
        with LocalDock(["bench"], capacity=64, n_warehouses=1, transport=transport) as local:
            async with DockClient(local.controller_endpoint, request_timeout_s=60.0) as dock:
                payloads = {k: torch.full((n,), 7, dtype=torch.uint8) for k, n in sizes.items()}
                for payload in payloads.values():  # warm-up, with a byte-exact check of every side
                    _raw_put_fetch(sock, payload, check=True)
                    await _araw_put_fetch(asock, payload, check=True)
                    await _dock_put_fetch(dock, payload, check=True)
                for rep in range(reps):
                    for label, payload in payloads.items():
                        iters = max(3, min(200, round(scale * BYTES_PER_MEASURE / payload.numel())))
                        order = systems[rep % 3:] + systems[: rep % 3]  # rotate who goes first
                        for system in order:
                            total = 0.0
                            for _ in range(iters):
                                if system == "raw":
                                    total += _raw_put_fetch(sock, payload)
                                elif system == "araw":
                                    total += await _araw_put_fetch(asock, payload)
                                else:
                                    total += await _dock_put_fetch(dock, payload)
                            out[system][label].append(2 * payload.numel() * iters / total / MB)
    finally:
        sock.close(linger=0)
        asock.close(linger=0)
        zctx.term()
        actx.term()
    return out


# ====================================================================== 2/3. claims
async def _preload(endpoint: str, n: int, tensors: bool = False, timeout_s: float = 60.0,
                   auth: ClientAuth | None = None) -> None:
    """Add ``n`` samples with a ``tokens`` column; wait until the controller has all live samples ready.

    ``tensors``: int64[256] per sample (for runs that fetch); else a small int per sample, which
    preloads faster and is all a claim-only run needs (the controller never sees the values).

    The warehouse tells the controller about a put before it answers the put, but on another
    connection, so readiness is checked rather than assumed. Consumers that never claimed have no
    view (and no ready count) yet; for them the claim loops count ``NothingToClaim`` as ``empty``.
    """
    tokens = torch.arange(TOKENS_PER_SAMPLE, dtype=torch.int64)
    async with DockClient(endpoint, request_timeout_s=60.0, auth=auth) as dock:
        left = n
        while left > 0:
            k = min(4096, left)
            await dock.add({"tokens": [tokens] * k if tensors else list(range(k))})
            left -= k
        deadline = time.monotonic() + timeout_s
        while True:
            stats = (await dock.server_statistics())["controller"]
            live = stats["in_flight"]
            views = [c for c in stats["consumers"].values() if c["reads"] is not None]
            if all(c["ready"] >= live for c in views):  # between reps every live sample is new
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"preloaded samples not ready at the controller within {timeout_s} s: {stats}")
            await anyio.sleep(0.01)


def _lat_stats(results: Sequence[dict[str, Any]]) -> tuple[float, float, int]:
    lat = sorted(x for r in results for x in r["lat"])
    return percentile(lat, 0.5) * 1e3, percentile(lat, 0.99) * 1e3, len(lat)


def _rate(results: Sequence[dict[str, Any]]) -> float:
    start = min(s for r in results for s, _ in r["spans"])
    end = max(e for r in results for _, e in r["spans"])
    return sum(r["samples"] for r in results) / (end - start)


def bench_claims(
    pool: WorkerPool, raw_ctl: RawServer, raw_data: RawServer, transport: Transport, args: argparse.Namespace
) -> dict[str, dict[str, list[float]]]:
    """Claim throughput (procs x clients claim+ack) and unloaded claim->fetch latency."""
    keys = ("samples_per_s", "load_p50_ms", "load_p99_ms", "server_cpu_us_per_claim", "server_cpu_share",
            "client_cpu_share",
            "pipe_samples_per_s", "pipe_server_cpu_share", "pipe_server_cpu_us_per_claim",
            "fetch_p50_ms", "fetch_p99_ms", "empty")
    out: dict[str, dict[str, list[float]]] = {s: {k: [] for k in keys} for s in ("raw", "dock")}
    n_tasks = args.claim_procs * args.claim_clients
    per_task = max(1, args.claim_samples // (n_tasks * MICRO_BATCH))
    n_samples = per_task * n_tasks * MICRO_BATCH
    # each run drains what it preloaded
    capacity = max(args.pipe_factor * n_samples, args.fetch_iters * MICRO_BATCH) + 64
    with LocalDock(["train"], capacity=capacity, n_warehouses=1, transport=transport) as local:
        ctl_pid = local.pids[0]
        for rep in range(args.reps):
            for system in ("raw", "dock") if rep % 2 == 0 else ("dock", "raw"):
                ep = local.controller_endpoint if system == "dock" else raw_ctl.endpoints[transport]
                pid = ctl_pid if system == "dock" else raw_ctl.pid
                if system == "dock":
                    asyncio.run(_preload(ep, n_samples))
                jobs = [
                    {"kind": "claim_loop", "system": system, "endpoint": ep, "n_clients": args.claim_clients,
                     "claims_per_task": per_task, "think_s": 0.0, "consumer": "train", "seed": rep * 100 + k}
                    for k in range(args.claim_procs)
                ]
                cpu0 = _cpu_seconds(pid)
                results, t0, t1 = pool.run(jobs)
                cpu = _cpu_seconds(pid) - cpu0
                rate = _rate(results)
                p50, p99, n_claims = _lat_stats(results)
                o = out[system]
                o["samples_per_s"].append(rate)
                o["load_p50_ms"].append(p50)
                o["load_p99_ms"].append(p99)
                o["server_cpu_us_per_claim"].append(cpu / n_claims * 1e6)
                o["server_cpu_share"].append(cpu / (t1 - t0))
                o["client_cpu_share"].append(sum(r["client_cpu_s"] for r in results) / (t1 - t0))
                o["empty"].append(sum(r["empty"] for r in results))
                # controller-bound: pipelined protocol-level clients, same number of samples
                per_proc = args.pipe_factor * n_samples // (args.claim_procs * MICRO_BATCH)
                if system == "dock":
                    asyncio.run(_preload(ep, per_proc * args.claim_procs * MICRO_BATCH))
                jobs = [{"kind": "claim_pipe", "system": system, "endpoint": ep, "claims": per_proc,
                         "depth": args.pipe_depth, "consumer": "train"} for _ in range(args.claim_procs)]
                cpu0 = _cpu_seconds(pid)
                results, t0, t1 = pool.run(jobs)
                cpu = _cpu_seconds(pid) - cpu0
                o["pipe_samples_per_s"].append(_rate(results))
                o["pipe_server_cpu_share"].append(cpu / (t1 - t0))
                o["pipe_server_cpu_us_per_claim"].append(cpu / (per_proc * args.claim_procs) * 1e6)
                # claim -> fetch latency, one client, unloaded
                if system == "dock":
                    asyncio.run(_preload(ep, args.fetch_iters * MICRO_BATCH, tensors=True))
                job = {"kind": "claim_fetch", "system": system, "endpoint": ep, "iters": args.fetch_iters,
                       "consumer": "train", "data_endpoint": raw_data.endpoints[transport]}
                [res], _, _ = pool.run([job])
                lat = sorted(res["lat"])
                o["fetch_p50_ms"].append(percentile(lat, 0.5) * 1e3)
                o["fetch_p99_ms"].append(percentile(lat, 0.99) * 1e3)
    return out


def bench_scale(
    pool: WorkerPool, raw_ctl: RawServer, transport: Transport, args: argparse.Namespace
) -> dict[str, dict[str, list[float]]]:
    """384 consumers (procs x clients) claiming at a think-time pace from one controller."""
    keys = ("p50_ms", "p99_ms", "probe_p50_ms", "probe_p99_ms", "claims_per_s", "server_cpu_share",
            "client_cpu_share", "server_runq_wait_ms", "empty")
    out: dict[str, dict[str, list[float]]] = {s: {k: [] for k in keys} for s in ("raw", "dock")}
    think_s = args.scale_think_ms / 1e3
    per_task = max(1, math.ceil(args.scale_seconds / think_s)) if think_s else args.scale_claims
    consumers = [f"c{k}" for k in range(args.scale_consumers)]
    procs_per_consumer = math.ceil(args.scale_procs / len(consumers))
    n_samples = procs_per_consumer * args.scale_clients * per_task * MICRO_BATCH
    with LocalDock(consumers, capacity=n_samples + 64, n_warehouses=1, transport=transport) as local:
        ctl_pid = local.pids[0]
        for rep in range(args.reps):
            for system in ("raw", "dock") if rep % 2 == 0 else ("dock", "raw"):
                ep = local.controller_endpoint if system == "dock" else raw_ctl.endpoints[transport]
                pid = ctl_pid if system == "dock" else raw_ctl.pid
                jobs = []
                tasks_of: dict[str, int] = dict.fromkeys(consumers, 0)
                for k in range(args.scale_procs):
                    consumer = consumers[k % len(consumers)]
                    tasks_of[consumer] += args.scale_clients
                    jobs.append({"kind": "claim_loop", "system": system, "endpoint": ep,
                                 "n_clients": args.scale_clients, "claims_per_task": per_task, "think_s": think_s,
                                 "consumer": consumer, "seed": rep * 100 + k})
                if system == "dock":
                    # each consumer name gets exactly what its workers claim; top up to the largest need
                    stats = asyncio.run(_controller_stats(ep))
                    need = max(tasks_of.values()) * per_task * MICRO_BATCH
                    asyncio.run(_preload(ep, need - stats["in_flight"]))
                    # consumers with fewer workers leave samples behind: give each job an exact share
                    for job in jobs:
                        job["claims_per_task"] = need // (tasks_of[job["consumer"]] * MICRO_BATCH)
                probe = {"kind": "claim_probe", "system": system, "endpoint": ep, "consumer": consumers[0],
                         "interval_s": args.probe_ms / 1e3, "duration_s": per_task * think_s if think_s else 1.0}
                cpu0, (wait0, runs0) = _cpu_seconds(pid), _sched_wait(pid)
                results, t0, t1 = pool.run([*jobs, probe])
                cpu = _cpu_seconds(pid) - cpu0
                wait1, runs1 = _sched_wait(pid)
                out[system]["server_runq_wait_ms"].append((wait1 - wait0) / max(1, runs1 - runs0) * 1e3)
                probe_res, results = results[-1], results[:-1]
                p50, p99, n_claims = _lat_stats(results)
                o = out[system]
                o["p50_ms"].append(p50)
                o["p99_ms"].append(p99)
                probe_p50, probe_p99, _ = _lat_stats([probe_res])
                o["probe_p50_ms"].append(probe_p50)
                o["probe_p99_ms"].append(probe_p99)
                o["claims_per_s"].append(n_claims / (t1 - t0))
                o["server_cpu_share"].append(cpu / (t1 - t0))
                o["client_cpu_share"].append(sum(r["client_cpu_s"] for r in results) / (t1 - t0))
                o["empty"].append(sum(r["empty"] for r in results))
    return out


SEC_SIDES = ("plaintext", "plain", "curve")  # no authentication, auth-only (ZAP PLAIN), CURVE
CURVE_VARIANTS = ("curve_io2", "curve_io2_2conn")  # bandwidth only: what makes CURVE faster
SEC_SIZES = ("4MiB", "64MiB")
BENCH_ROLE = "stage:bench"


def _rotated(sides: Sequence[str], rep: int) -> list[str]:
    """Every side first once in a while: a side's figures never all come right after the same other."""
    k = rep % len(sides)
    return [*sides[k:], *sides[:k]]


async def _security_bandwidth(endpoints: dict[str, str], auth: dict[str, ClientAuth | None], reps: int,
                              sizes: dict[str, int], scale: float) -> dict[str, dict[str, list[float]]]:
    """Dock put+fetch MB/s per size over tcp, per side, repetitions interleaved."""
    sides = (*SEC_SIDES, *CURVE_VARIANTS)
    out: dict[str, dict[str, list[float]]] = {side: {k: [] for k in sizes} for side in sides}
    io2 = zmq.asyncio.Context(io_threads=2)  # CURVE encrypts in the I/O threads: one per connection at most
    try:
        async with contextlib.AsyncExitStack() as stack:
            clients: dict[str, list[DockClient]] = {}
            for side in sides:
                base = side.split("_")[0]
                n, ctx = (2, io2) if side.endswith("2conn") else (1, io2 if side != base else None)
                clients[side] = [await stack.enter_async_context(
                    DockClient(endpoints[side], request_timeout_s=60.0, auth=auth[base], context=ctx))
                    for _ in range(n)]
            payloads = {k: torch.full((n,), 7, dtype=torch.uint8) for k, n in sizes.items()}
            for payload in payloads.values():  # warm-up, byte-exact on every side
                for cs in clients.values():
                    for c in cs:
                        await _dock_put_fetch(c, payload, check=True)
            for rep in range(reps):
                for label, payload in payloads.items():
                    iters = max(4, min(200, round(scale * BYTES_PER_MEASURE / payload.numel())))
                    for side in _rotated(sides, rep):
                        cs = clients[side]
                        if len(cs) == 1:  # as phase 1: the put+fetch parts only
                            total = 0.0
                            for _ in range(iters):
                                total += await _dock_put_fetch(cs[0], payload)
                            out[side][label].append(2 * payload.numel() * iters / total / MB)
                            continue
                        t0 = time.perf_counter()
                        async with anyio.create_task_group() as tg:  # the connections in parallel
                            for c in cs:
                                tg.start_soon(_put_fetch_n, c, payload, iters // len(cs))
                        # wall time, which includes each iteration's untimed reserve, claim and ack
                        # (the parts overlap): a lower bound, comparable to the others at 4 MiB and up
                        wall = time.perf_counter() - t0
                        moved = 2 * payload.numel() * (iters // len(cs)) * len(cs)
                        out[side][label].append(moved / wall / MB)
    finally:
        io2.term()
    return out


async def _put_fetch_n(dock: DockClient, payload: torch.Tensor, n: int) -> None:
    for _ in range(n):
        await _dock_put_fetch(dock, payload)


def bench_security(pool: WorkerPool, args: argparse.Namespace, sizes: dict[str, int],
                   bw_scale: float) -> dict[str, dict[str, list[float]]]:
    """Phase 4: the tcp bandwidth and claim-rate figures of docks without authentication, with
    auth-only (PLAIN) and with CURVE."""
    creds = {"plaintext": None, "plain": RunCredentials.generate("plain", [BENCH_ROLE]),
             "curve": RunCredentials.generate("curve", [BENCH_ROLE])}
    auth = {side: c.client(BENCH_ROLE) if c is not None else None for side, c in creds.items()}
    bw_sizes = {k: v for k, v in sizes.items() if k in SEC_SIZES}
    with contextlib.ExitStack() as stack:
        docks = {side: stack.enter_context(LocalDock(["bench"], capacity=64, n_warehouses=1, transport="tcp",
                                                     auth=c)) for side, c in creds.items()}
        # the CURVE variants' dock: its warehouse's context has 2 I/O threads (the environment
        # variable the servers read; streamrl.dock.warehouse)
        os.environ["STREAMRL_ZMQ_IO_THREADS"] = "2"
        try:
            docks["curve_io2"] = stack.enter_context(LocalDock(["bench"], capacity=64, n_warehouses=1,
                                                               transport="tcp", auth=creds["curve"]))
        finally:
            del os.environ["STREAMRL_ZMQ_IO_THREADS"]
        endpoints = {side: d.controller_endpoint for side, d in docks.items()}
        endpoints["curve_io2_2conn"] = endpoints["curve_io2"]
        bw = asyncio.run(_security_bandwidth(endpoints, auth, args.reps, bw_sizes, bw_scale))
    out: dict[str, dict[str, list[float]]] = {
        side: {f"bw_{label}": v for label, v in res.items()} | {"samples_per_s": [], "pipe_samples_per_s": []}
        for side, res in bw.items()
    }
    n_tasks = args.claim_procs * args.claim_clients
    per_task = max(1, args.claim_samples // (n_tasks * MICRO_BATCH))
    n_samples = per_task * n_tasks * MICRO_BATCH
    per_proc = args.pipe_factor * n_samples // (args.claim_procs * MICRO_BATCH)
    capacity = args.pipe_factor * n_samples + 64
    with contextlib.ExitStack() as stack:
        docks = {side: stack.enter_context(LocalDock(["train"], capacity=capacity, n_warehouses=1, transport="tcp",
                                                     auth=c)) for side, c in creds.items()}
        for rep in range(args.reps):
            for side in _rotated(SEC_SIDES, rep):
                ep, a = docks[side].controller_endpoint, auth[side]
                secret = a.to_env() if a is not None else None  # to our own worker processes only
                asyncio.run(_preload(ep, n_samples, auth=a))
                jobs = [{"kind": "claim_loop", "system": "dock", "endpoint": ep, "n_clients": args.claim_clients,
                         "claims_per_task": per_task, "think_s": 0.0, "consumer": "train", "seed": rep * 100 + j,
                         "auth": secret} for j in range(args.claim_procs)]
                results, _, _ = pool.run(jobs)
                out[side]["samples_per_s"].append(_rate(results))
                asyncio.run(_preload(ep, per_proc * args.claim_procs * MICRO_BATCH, auth=a))
                jobs = [{"kind": "claim_pipe", "system": "dock", "endpoint": ep, "claims": per_proc,
                         "depth": args.pipe_depth, "consumer": "train", "auth": secret}
                        for _ in range(args.claim_procs)]
                results, _, _ = pool.run(jobs)
                out[side]["pipe_samples_per_s"].append(_rate(results))
    return out


async def _controller_stats(endpoint: str) -> dict[str, Any]:
    async with DockClient(endpoint, request_timeout_s=30.0) as dock:
        return (await dock.server_statistics())["controller"]


# ====================================================================== driver
def _sp(values: Sequence[float]) -> dict[str, float]:
    return spread(values)


def _side_by_side(
    res: dict[str, dict[str, list[float]]], names: dict[str, tuple[str, int]]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, float], list[list[str]]]:
    """Spreads of every named figure for dock and raw, their median ratio, and table rows."""
    fig: dict[str, Any] = {}
    base: dict[str, Any] = {}
    rat: dict[str, float] = {}
    rows = []
    for key, (title, digits) in names.items():
        d, r = _sp(res["dock"][key]), _sp(res["raw"][key])
        fig[key], base[key] = d, r
        rat[key] = d["median"] / r["median"] if r["median"] else math.nan
        rows.append([title, fmt_spread(r, digits), fmt_spread(d, digits), f"{rat[key]:.2f}"])
    return fig, base, rat, rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations and samples (about 1 minute)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of every figure (median and min/max)")
    ap.add_argument("--phases", default="bandwidth,claims,scale", help="comma-separated subset to run "
                    "(also: security)")
    ap.add_argument("--security", "--curve", action="store_true", help="add phase 4: the dock's tcp bandwidth "
                    "and claim rates without authentication, with auth-only (PLAIN) and with CURVE, in the same run")
    ap.add_argument("--transports", default="tcp,ipc", help="bandwidth transports")
    ap.add_argument("--claim-transport", default="tcp", choices=["tcp", "ipc"], help="transport of phases 2-3")
    ap.add_argument("--claim-procs", type=int, default=2, help="client processes of the throughput phase")
    ap.add_argument("--claim-clients", type=int, default=16, help="DockClients (one task each) per process")
    ap.add_argument("--claim-samples", type=int, default=32_000, help="samples claimed per repetition")
    ap.add_argument("--pipe-depth", type=int, default=16,
                    help="claims in flight per pipelined protocol-level client (controller-bound run)")
    ap.add_argument("--pipe-factor", type=int, default=2,
                    help="the pipelined run claims this many times --claim-samples (it is fast)")
    ap.add_argument("--fetch-iters", type=int, default=300, help="claim->fetch round trips per repetition")
    ap.add_argument("--scale-procs", type=int, default=4, help="client processes of the scale phase")
    ap.add_argument("--scale-clients", type=int, default=96, help="DockClients per scale process")
    ap.add_argument("--scale-consumers", type=int, default=4, help="consumer names; process k claims as c{k %% n}")
    ap.add_argument("--scale-think-ms", type=float, default=100.0,
                    help="mean time a worker holds a lease before acking (its stage's compute); 0: closed loop")
    ap.add_argument("--scale-seconds", type=float, default=3.0, help="duration of one scale repetition")
    ap.add_argument("--probe-ms", type=float, default=5.0, help="interval of the probe client's timed claims")
    ap.add_argument("--scale-claims", type=int, default=20, help="claims per worker when --scale-think-ms is 0")
    args = ap.parse_args(argv)
    for name in ("reps", "claim_procs", "claim_clients", "claim_samples", "pipe_depth", "pipe_factor",
                 "fetch_iters", "scale_procs", "scale_clients", "scale_claims"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.scale_think_ms < 0 or args.scale_seconds <= 0 or args.probe_ms <= 0:
        ap.error("--scale-think-ms must be >= 0, --scale-seconds and --probe-ms > 0")
    if args.scale_consumers < 1 or args.scale_procs % args.scale_consumers:
        ap.error("--scale-procs must be a multiple of --scale-consumers (each name gets the same workers)")
    phases = set(args.phases.split(","))
    phases = {"security" if ph == "curve" else ph for ph in phases}  # its name before auth-only joined it
    if phases - {"bandwidth", "claims", "scale", "security"}:
        ap.error(f"unknown phase in --phases {args.phases!r}: use bandwidth, claims, scale, security")
    if args.security:
        phases.add("security")
    if args.quick:
        args.claim_samples = min(args.claim_samples, 16_000)
        args.fetch_iters = min(args.fetch_iters, 150)
        args.scale_seconds = min(args.scale_seconds, 1.5)
    bw_scale = 0.4 if args.quick else 1.0
    transports: list[Transport] = []
    for t in args.transports.split(","):
        if t not in ("tcp", "ipc"):
            ap.error(f"--transports takes tcp and/or ipc, got {t!r}")
        transports.append(t)  # type: ignore[arg-type]

    t_start = time.monotonic()
    load0 = os.getloadavg()
    print(f"dock benchmark: {args.reps} reps, load average {load0[0]:.2f} on {os.cpu_count()} cores "
          "(shared machine: expect noise)", flush=True)
    ipc_dir = tempfile.mkdtemp(prefix="srl-bench-", dir="/tmp")
    servers: list[RawServer] = []
    pool: WorkerPool | None = None
    bw: dict[str, dict[str, dict[str, list[float]]]] = {}
    cl: dict[str, dict[str, list[float]]] | None = None
    sc: dict[str, dict[str, list[float]]] | None = None
    cv: dict[str, dict[str, list[float]]] | None = None
    try:
        raw_ctl = RawServer("ctl", ipc_dir)
        servers.append(raw_ctl)
        raw_data = RawServer("data", ipc_dir)
        servers.append(raw_data)
        if "bandwidth" in phases:
            for tr in transports:
                bw[tr] = asyncio.run(bench_bandwidth(tr, raw_data.endpoints[tr], args.reps, SIZES, bw_scale))
                print(f"  bandwidth over {tr} done ({time.monotonic() - t_start:.0f} s)", flush=True)
        if phases & {"claims", "scale", "security"}:
            pool = WorkerPool(max(args.claim_procs if phases & {"claims", "security"} else 1,
                                  args.scale_procs + 1 if "scale" in phases else 1))
        if "claims" in phases:
            assert pool is not None
            cl = bench_claims(pool, raw_ctl, raw_data, args.claim_transport, args)
            print(f"  claims done ({time.monotonic() - t_start:.0f} s)", flush=True)
        if "scale" in phases:
            assert pool is not None
            sc = bench_scale(pool, raw_ctl, args.claim_transport, args)
            print(f"  scale done ({time.monotonic() - t_start:.0f} s)", flush=True)
        if "security" in phases:
            assert pool is not None
            cv = bench_security(pool, args, SIZES, bw_scale)
            print(f"  security done ({time.monotonic() - t_start:.0f} s)", flush=True)
    finally:
        if pool is not None:
            pool.close()
        for s in servers:
            s.stop()
        shutil.rmtree(ipc_dir, ignore_errors=True)

    figures: dict[str, Any] = {}
    baseline: dict[str, Any] = {}
    ratios: dict[str, Any] = {}
    target: dict[str, Any] = {}
    # ------------------------------------------------------------------ bandwidth table
    if bw:
        rows = []
        figures["bandwidth_MBps"], baseline["bandwidth_MBps"], ratios["bandwidth_dock_over_raw"] = {}, {}, {}
        worst_large = math.inf
        for tr, res in bw.items():
            figures["bandwidth_MBps"][tr], baseline["bandwidth_MBps"][tr], ratios["bandwidth_dock_over_raw"][tr] = {}, {}, {}
            for label in SIZES:
                d, r, a = _sp(res["dock"][label]), _sp(res["raw"][label]), _sp(res["araw"][label])
                # ratio per repetition (raw and dock of one rep ran back to back), then its spread
                rr = _sp([a / b for a, b in zip(res["dock"][label], res["raw"][label], strict=True)])
                figures["bandwidth_MBps"][tr][label] = d
                baseline["bandwidth_MBps"][tr][label] = r
                baseline.setdefault("bandwidth_MBps_raw_asyncio", {}).setdefault(tr, {})[label] = a
                ratios["bandwidth_dock_over_raw"][tr][label] = rr
                if SIZES[label] >= 4 << 20:
                    worst_large = min(worst_large, rr["median"])
                ra = _sp([x / y for x, y in zip(res["dock"][label], res["araw"][label], strict=True)])
                ratios.setdefault("bandwidth_dock_over_raw_asyncio", {}).setdefault(tr, {})[label] = ra
                rows.append([tr, label, fmt_spread(r, 0), fmt_spread(a, 0), fmt_spread(d, 0), fmt_spread(rr, 2),
                             f"{ra['median']:.2f}"])
        print("\n1. Bandwidth, put+fetch round trip (MB/s, median [min, max])")
        print_table(["transport", "size", "raw pyzmq (sync)", "raw pyzmq (asyncio)", "dock", "dock/raw",
                     "dock/raw-asyncio"], rows)
        target["bandwidth_dock_over_raw_at_ge_4MiB"] = {
            "min": TARGETS["bandwidth_ratio_min"], "worst_median": worst_large,
            "met": worst_large >= TARGETS["bandwidth_ratio_min"],
        }
    # ------------------------------------------------------------------ claims table
    if cl is not None:
        names = {
            "samples_per_s": ("sample-claims/s (claim 8 + ack)", 0),
            "load_p50_ms": ("claim round trip p50 under that load (ms)", 2),
            "load_p99_ms": ("claim round trip p99 under that load (ms)", 2),
            "server_cpu_share": ("server CPU share during the run (cores)", 2),
            "server_cpu_us_per_claim": ("server CPU per claim+ack (us)", 1),
            "client_cpu_share": ("client processes' CPU share (cores)", 2),
            "pipe_samples_per_s": ("pipelined sample-claims/s (controller-bound)", 0),
            "pipe_server_cpu_share": ("  server CPU share, pipelined (cores)", 2),
            "pipe_server_cpu_us_per_claim": ("  server CPU per claim+ack, pipelined (us)", 1),
            "fetch_p50_ms": ("claim->fetch p50, unloaded (ms)", 2),
            "fetch_p99_ms": ("claim->fetch p99, unloaded (ms)", 2),
        }
        figures["claims"], baseline["claims"], ratios["claims_dock_over_raw"], rows = _side_by_side(cl, names)
        dock_cpu = figures["claims"]["pipe_server_cpu_us_per_claim"]["median"]
        figures["claims"]["controller_capacity_samples_per_s_one_core"] = (
            MICRO_BATCH * 1e6 / dock_cpu if dock_cpu else math.nan)
        figures["claims"]["empty_claims"] = _sp(cl["dock"]["empty"])
        print(f"\n2. Claims: {args.claim_procs} procs x {args.claim_clients} clients, micro-batch {MICRO_BATCH}, "
              f"{args.claim_transport} (median [min, max])")
        print_table(["figure", "raw pyzmq", "dock", "dock/raw"], rows)
        print(f"controller capacity if it had a whole core: "
              f"{figures['claims']['controller_capacity_samples_per_s_one_core']:.0f} sample-claims/s")
        lo = TARGETS["claim_samples_per_s_min"]
        rate = figures["claims"]["pipe_samples_per_s"]["median"]
        target["claim_samples_per_s_controller"] = {"min": lo, "median": rate, "met": rate >= lo}
        rate = figures["claims"]["samples_per_s"]["median"]
        target["claim_samples_per_s_dockclient"] = {"min": lo, "median": rate, "met": rate >= lo}
    # ------------------------------------------------------------------ scale table
    if sc is not None:
        names = {
            "p50_ms": ("claim round trip p50 (ms)", 2),
            "p99_ms": ("claim round trip p99 (ms)", 2),
            "probe_p50_ms": ("probe claim round trip p50 (ms)", 2),
            "probe_p99_ms": ("probe claim round trip p99 (ms)", 2),
            "claims_per_s": ("claims/s achieved", 0),
            "server_cpu_share": ("server CPU share (cores)", 2),
            "client_cpu_share": ("client processes' CPU share (cores)", 2),
            "server_runq_wait_ms": ("server run-queue wait per wake-up (ms)", 3),
        }
        figures["scale"], baseline["scale"], ratios["scale_dock_over_raw"], rows = _side_by_side(sc, names)
        figures["scale"]["empty_claims"] = _sp(sc["dock"]["empty"])
        n = args.scale_procs * args.scale_clients
        print(f"\n3. Scale: {n} consumers ({args.scale_procs} procs x {args.scale_clients} DockClients, "
              f"{args.scale_consumers} consumer names), think {args.scale_think_ms:g} ms, {args.claim_transport}")
        print_table(["figure", "raw pyzmq", "dock", "dock/raw"], rows)
        hi = TARGETS["scale_p99_ms_max"]
        p99 = figures["scale"]["p99_ms"]["median"]
        target["scale_p99_ms_workers"] = {"max": hi, "median": p99, "met": p99 < hi}
        p99 = figures["scale"]["probe_p99_ms"]["median"]
        target["scale_p99_ms_probe"] = {"max": hi, "median": p99, "met": p99 < hi}
    # ------------------------------------------------------------------ security table
    if cv is not None:
        names = {f"bw_{label}": (f"put+fetch {label} (MB/s)", 0) for label in SEC_SIZES}
        names |= {"samples_per_s": ("sample-claims/s, DockClients (claim 8 + ack)", 0),
                  "pipe_samples_per_s": ("pipelined sample-claims/s (controller-bound)", 0)}
        rows = []
        figures["security"], baseline["security_plaintext"], ratios["security_over_plaintext"] = {}, {}, {}
        shown = (*SEC_SIDES[1:], *CURVE_VARIANTS)
        for key, (title, digits) in names.items():
            pl = _sp(cv["plaintext"][key])
            baseline["security_plaintext"][key] = pl
            row = [title, fmt_spread(pl, digits)]
            for side in shown:
                if not cv[side].get(key):
                    row.append("")
                    continue
                f = _sp(cv[side][key])
                figures["security"].setdefault(side, {})[key] = f
                # the ratio per repetition (the sides of one repetition ran back to back, under the
                # same load), then its spread: steadier than a ratio of medians on a shared machine
                rr = _sp([x / y for x, y in zip(cv[side][key], cv["plaintext"][key], strict=True)])
                ratios["security_over_plaintext"].setdefault(side, {})[key] = rr
                r = rr["median"]
                row.append(f"{fmt_spread(f, digits)} ({r:.2f})")
            rows.append(row)
        print(f"\n4. Security: the dock over tcp, {args.claim_procs} procs x {args.claim_clients} clients for claims "
              "(median [min, max], (median of the per-repetition ratios to plaintext))")
        print_table(["figure", "plaintext", "auth-only (PLAIN)", "CURVE", "CURVE, io_threads 2",
                     "CURVE, io_threads 2, 2 connections"], rows)
        plain = {k: v["median"] for k, v in ratios["security_over_plaintext"]["plain"].items()}
        target["auth_only_bandwidth_4MiB"] = {"min": 0.95, "ratio": plain["bw_4MiB"], "met": plain["bw_4MiB"] >= 0.95}
        for key in ("samples_per_s", "pipe_samples_per_s"):
            target[f"auth_only_{key}"] = {"min": 0.90, "ratio": plain[key], "met": plain[key] >= 0.90}
    # ------------------------------------------------------------------ verdict + JSON
    print("\nTargets:", ", ".join(f"{k}: {'met' if v['met'] else 'NOT met'}" for k, v in target.items()))
    wall = time.monotonic() - t_start
    print(f"wall time {wall:.0f} s; load average at start {load0[0]:.2f}, at end {os.getloadavg()[0]:.2f}")
    print_json_line(
        "dock", figures, baseline, ratios, target,
        config={"reps": args.reps, "quick": args.quick, "micro_batch": MICRO_BATCH,
                "claim_layout": [args.claim_procs, args.claim_clients],
                "scale_layout": [args.scale_procs, args.scale_clients, args.scale_consumers],
                "scale_think_ms": args.scale_think_ms, "claim_transport": args.claim_transport},
        environment={"cores": os.cpu_count(), "load_avg_start": load0[0], "wall_s": wall},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
