"""Benchmark: external reward servers (zmq backend) against the in-process backend.

1. Trivial reward (len of the response): scoring throughput with 4 concurrent callers, and the
   latency one batch pays for going through a server (sequential calls) — zmq vs in-process.
2. Scaling: a batched reward that takes 20 ms per batch (sleep, like waiting on a model or a
   sandbox), servers with one worker each, 1 → 2 → 4 servers; ideal is linear.

Each figure is the median [min, max] of --runs repetitions. The last line is one JSON object.

    python ops/bench/reward_servers.py [--runs 3] [--quick]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(REPO), str(HERE)]

from _common import fmt_spread, percentile, print_json_line, print_table, ratio, spread  # noqa: E402

from streamrl.rewards import InProcessRewardBackend, RewardClient, RewardSample, batched  # noqa: E402

SPEC_TRIVIAL = "reward_servers:trivial_reward"
SPEC_20MS = "reward_servers:twenty_ms_reward"
BATCH = 32


def trivial_reward(response: str) -> float:
    return float(len(response))


@batched
def twenty_ms_reward(responses: list[str]) -> list[float]:
    time.sleep(0.020)
    return [float(len(r)) for r in responses]


@contextmanager
def reward_servers(spec: str, count: int, workers: int) -> Iterator[list[str]]:
    """Start ``count`` server processes; yield their endpoints; always stop them."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE)])}
    procs = []
    try:
        for _ in range(count):
            proc = subprocess.Popen(
                [sys.executable, "-m", "streamrl.rewards.cli", "reward-server", spec,
                 "--bind", "tcp://127.0.0.1:0", "--workers", str(workers), "--log-level", "WARNING"],
                stdout=subprocess.PIPE, text=True, env=env,
            )  # fmt: skip
            procs.append(proc)
        endpoints = []
        for proc in procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()  # the server prints READY within a second; it exits on error
            if not line.startswith("READY "):
                raise RuntimeError(f"reward server did not start (got {line!r})")
            endpoints.append(line.split()[1])
        yield endpoints
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
            if proc.stdout:
                proc.stdout.close()


def make_batches(n_batches: int, size: int) -> list[list[RewardSample]]:
    return [
        [RewardSample(id=b * size + i, prompt="p", response="r" * (i % 50)) for i in range(size)]
        for b in range(n_batches)
    ]


Score = Callable[[list[RewardSample]], Awaitable[list]]


async def throughput(score: Score, batches: list[list[RewardSample]], callers: int) -> float:
    """Samples per second with ``callers`` concurrent score() calls."""
    queue = iter(batches)

    async def caller() -> None:
        for batch in queue:
            results = await score(batch)
            assert len(results) == len(batch)

    started = time.perf_counter()
    async with anyio.create_task_group() as group:
        for _ in range(callers):
            group.start_soon(caller)
    return sum(map(len, batches)) / (time.perf_counter() - started)


async def latencies_ms(score: Score, batches: list[list[RewardSample]]) -> list[float]:
    """Per-call latency of sequential score() calls, sorted."""
    values = []
    for batch in batches:
        started = time.perf_counter()
        await score(batch)
        values.append((time.perf_counter() - started) * 1000)
    return sorted(values)


async def measure_trivial(n_batches: int) -> dict[str, dict[str, float]]:
    batches = make_batches(n_batches, BATCH)
    out: dict[str, dict[str, float]] = {}
    async with InProcessRewardBackend(trivial_reward, max_concurrency=4) as backend:
        await backend.score(batches[0])  # warm-up
        out["inproc_throughput"] = {"v": await throughput(backend.score, batches, 4)}
        lat = await latencies_ms(backend.score, batches[: n_batches // 2])
        out["inproc_latency"] = {"p50": percentile(lat, 0.5), "p99": percentile(lat, 0.99)}
    with reward_servers(SPEC_TRIVIAL, 1, workers=4) as endpoints:
        async with RewardClient(endpoints, max_batch_size=BATCH) as client:
            await client.wait_servers_up(timeout_s=30)
            await client.score(batches[0])
            out["zmq_throughput"] = {"v": await throughput(client.score, batches, 4)}
            lat = await latencies_ms(client.score, batches[: n_batches // 2])
            out["zmq_latency"] = {"p50": percentile(lat, 0.5), "p99": percentile(lat, 0.99)}
    return out


async def measure_scaling(n_servers: int, n_batches: int) -> float:
    """Batches per second through ``n_servers`` one-worker servers of the 20 ms reward."""
    batches = make_batches(n_batches, 8)
    with reward_servers(SPEC_20MS, n_servers, workers=1) as endpoints:
        # Two in flight per server: the next batch waits at the server while one is scored.
        async with RewardClient(endpoints, max_in_flight_per_server=2, max_batch_size=8) as client:
            await client.wait_servers_up(timeout_s=30)
            await client.score(batches[0])
            samples_per_s = await throughput(client.score, batches, callers=2 * n_servers + 2)
            assert client.statistics().retries == 0
    return samples_per_s / 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="repetitions per figure (median and range)")
    parser.add_argument("--quick", action="store_true", help="fewer batches (smoke test)")
    args = parser.parse_args()
    n_trivial = 60 if args.quick else 1000
    n_scaling = {1: 20, 2: 40, 4: 80} if args.quick else {1: 100, 2: 200, 4: 400}

    trivial_runs = [anyio.run(measure_trivial, n_trivial) for _ in range(args.runs)]

    def series(key: str, field: str) -> dict[str, float]:
        return spread(run[key][field] for run in trivial_runs)

    inproc_tp, zmq_tp = series("inproc_throughput", "v"), series("zmq_throughput", "v")
    inproc_p50, zmq_p50 = series("inproc_latency", "p50"), series("zmq_latency", "p50")
    inproc_p99, zmq_p99 = series("inproc_latency", "p99"), series("zmq_latency", "p99")
    added_p50 = spread(r["zmq_latency"]["p50"] - r["inproc_latency"]["p50"] for r in trivial_runs)

    scaling = {
        n: spread(anyio.run(measure_scaling, n, n_scaling[n]) for _ in range(args.runs)) for n in (1, 2, 4)
    }

    print(
        f"trivial reward, batches of {BATCH} samples, {n_trivial} batches, {args.runs} runs (median [min, max])"
    )
    print_table(
        ["backend", "samples/s (4 callers)", "batch latency p50 ms", "batch latency p99 ms"],
        [
            ["in-process", fmt_spread(inproc_tp, 0), fmt_spread(inproc_p50, 3), fmt_spread(inproc_p99, 3)],
            ["zmq, 1 server", fmt_spread(zmq_tp, 0), fmt_spread(zmq_p50, 3), fmt_spread(zmq_p99, 3)],
        ],
    )
    print(f"added latency of the zmq backend, p50: {fmt_spread(added_p50, 3)} ms per batch")
    print()
    print("20 ms per batch reward (batches of 8), one worker per server")
    print_table(
        ["servers", "batches/s", "speed-up vs 1", "ideal"],
        [
            [n, fmt_spread(scaling[n], 1), f"{ratio(scaling[n], scaling[1]):.2f}", f"{n * 50}"]
            for n in (1, 2, 4)
        ],
    )
    print_json_line(
        "reward_servers",
        figures={
            "zmq_samples_per_s": zmq_tp,
            "zmq_batch_latency_p50_ms": zmq_p50,
            "zmq_batch_latency_p99_ms": zmq_p99,
            "added_latency_p50_ms": added_p50,
            "scaling_batches_per_s": {str(n): scaling[n] for n in (1, 2, 4)},
        },
        baseline={
            "inprocess_samples_per_s": inproc_tp,
            "inprocess_batch_latency_p50_ms": inproc_p50,
            "inprocess_batch_latency_p99_ms": inproc_p99,
            "one_server_batches_per_s": scaling[1],
        },
        ratio={
            "zmq_vs_inprocess_throughput": ratio(zmq_tp, inproc_tp),
            "scaling_2_vs_1": ratio(scaling[2], scaling[1]),
            "scaling_4_vs_1": ratio(scaling[4], scaling[1]),
        },
        target={"scaling_4_vs_1": ">= 3.2", "added_latency_p50_ms": "<= 2.0"},
        runs=args.runs,
    )


if __name__ == "__main__":
    main()
