#!/usr/bin/env python3
"""What an idle core costs the next message and the next compute call on this host.

A synchronous RL step is a chain of processes that take turns: while one computes, the others
wait, and their cores go idle. On a virtual machine an idle virtual CPU halts (after the guest's
short halt-poll), and the next wake-up that lands on it must first get it running again. This
benchmark measures that cost on the host it runs on, in three parts:

1. **Round trips after an idle gap.** A DEALER in this process and a ROUTER that echoes in a child
   process (ipc in a private temp dir), one 64-byte round trip after each gap of 0.3, 2, 5, 10
   and 20 ms; median and p90 per gap.
2. **The same with every core kept from halting**: one spinning process per core, pinned, at
   ``SCHED_IDLE`` (it runs only when nothing else wants the core, and any other thread preempts
   it at once), so no core of the host ever goes idle.
3. **A compute call after an idle gap.** W1's generate call (64 completions of <= 4 tokens, the
   built-in engine, 1 torch thread) back to back, and after sleeping 13 ms (about one phase of
   a synchronous W1 step), without and with the spinners.

With ``--pipeline-pairs N`` it also runs W1 (``configs/grpo_digits.yaml``, 260 steps, the stop
reward off) N times at each ``max_staleness`` 0 and 1, plain and with the spinners, alternating,
and reports ms a step over steps 30-230.

    python ops/bench/idle_wakeups.py
    python ops/bench/idle_wakeups.py --pipeline-pairs 2

Last line: one JSON object (figures: after the gaps and with the spinners; baseline: back to back;
ratio: after a 10 ms gap over back to back; no target: a property of the host).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ops.bench._common import percentile, print_json_line, print_table, spread  # noqa: E402

GAPS_MS = (0.3, 2.0, 5.0, 10.0, 20.0)
ROUND_TRIPS_S = 3.0  # wall time spent on each gap's round trips (bounded count below)
MAX_ROUND_TRIPS = 1500
COMPUTE_GAP_MS = 13.0
COMPUTE_CALLS = 150

_ECHO = """
import sys, zmq
ctx = zmq.Context()
s = ctx.socket(zmq.ROUTER)
s.bind(sys.argv[1])
while True:
    frames = s.recv_multipart()
    if frames[-1] == b"stop":
        break
    s.send_multipart(frames)
"""

_SPIN = """
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    for _ in range(100000):
        pass
"""


@contextlib.contextmanager
def spinners(on: bool, seconds: float) -> Iterator[None]:
    """One SCHED_IDLE spinning process per core of this process's affinity while inside (none if
    not ``on``); each stops by itself after ``seconds`` should this process die first."""
    procs = [subprocess.Popen([sys.executable, "-c", _SPIN, str(core), str(seconds)])
             for core in (sorted(os.sched_getaffinity(0)) if on else [])]
    try:
        time.sleep(0.3 if procs else 0.0)  # started and spinning
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(timeout=10)


def round_trips(gap_ms: float) -> list[float]:
    """Round trip times (µs) to an echoing child process, one after each ``gap_ms`` of sleep."""
    import zmq

    with tempfile.TemporaryDirectory(prefix="srl-wake-") as d:
        endpoint = f"ipc://{d}/echo"
        echo = subprocess.Popen([sys.executable, "-c", _ECHO, endpoint])
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 5000)  # a lost echo fails the benchmark instead of hanging it
        try:
            sock.connect(endpoint)
            sock.send_multipart([b"x" * 64])  # the connection made, the echo running
            sock.recv_multipart()
            times: list[float] = []
            deadline = time.perf_counter() + ROUND_TRIPS_S
            while len(times) < MAX_ROUND_TRIPS and time.perf_counter() < deadline:
                time.sleep(gap_ms / 1e3)
                t0 = time.perf_counter()
                sock.send_multipart([b"x" * 64])
                sock.recv_multipart()
                times.append((time.perf_counter() - t0) * 1e6)
            sock.send_multipart([b"stop"])
            echo.wait(timeout=10)
            return times
        finally:
            sock.close()
            ctx.term()
            if echo.poll() is None:
                echo.kill()
                echo.wait(timeout=10)


def generate_calls(gap_ms: float) -> list[float]:
    """W1's generate call (ms), 1 torch thread, one after each ``gap_ms`` of sleep."""
    import random

    import torch

    from streamrl.engines.rollout import TorchRolloutEngine
    from streamrl.models.build import TinyModelSpec, build_model
    from streamrl.models.tokenizer import build_char_tokenizer
    from streamrl.tasks import get_task

    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    model = build_model(TinyModelSpec(hidden=128, layers=2, heads=4, intermediate=256, max_positions=64, seed=0), tok)
    engine = TorchRolloutEngine(model, tok.eos_token_id, tok.pad_token_id, "cpu")
    task = get_task("digits-max", n_digits=3)
    rng = random.Random(0)
    generator = torch.Generator().manual_seed(0)
    times: list[float] = []
    for call in range(COMPUTE_CALLS + 20):
        prompts = [torch.tensor(tok(p.text)["input_ids"]) for p in task.make_prompts(rng, 8)]
        batch = [p for p in prompts for _ in range(8)]
        if gap_ms:
            time.sleep(gap_ms / 1e3)
        t0 = time.perf_counter()
        engine.generate(batch, max_new_tokens=4, temperature=1.0, generator=generator)
        if call >= 20:  # after the warm-up calls
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def pipeline_ms_per_step(staleness: int, run_dir: str) -> float:
    """W1's ms a step over steps 30-230 of a 260-step run (the stop reward off)."""
    cmd = [sys.executable, "-m", "streamrl.cli", "run", str(ROOT / "configs" / "grpo_digits.yaml"),
           "algo.stop_reward=null", "algo.steps=260", f"algo.max_staleness={staleness}", "output.progress=none",
           "output.checkpoint=false", "output.tensorboard=false", "output.plot=false", f"output.run_dir={run_dir}"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600, cwd=ROOT)
    metrics = next(Path(run_dir).glob("*/metrics.jsonl"))
    elapsed = {row["step"]: row["elapsed_s"] for row in map(json.loads, metrics.read_text().splitlines())}
    return (elapsed[230] - elapsed[30]) / 200 * 1e3


def summary(values: list[float]) -> dict[str, float]:
    """:func:`spread` and the p90."""
    return {**spread(values), "p90": percentile(sorted(values), 0.9)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pipeline-pairs", type=int, default=0,
                    help="W1 runs at each max_staleness, plain and with the spinners, alternating (0: none)")
    args = ap.parse_args()
    if not hasattr(os, "SCHED_IDLE"):
        sys.exit("idle_wakeups.py needs Linux (SCHED_IDLE, sched_setaffinity)")

    figures: dict[str, Any] = {}
    rows = []
    for awake in (False, True):
        label = "kept awake" if awake else "plain"
        with spinners(awake, seconds=ROUND_TRIPS_S * len(GAPS_MS) + 30):
            for gap in GAPS_MS:
                got = summary(round_trips(gap))
                figures[f"round_trip_us_gap_{gap:g}ms_{label.replace(' ', '_')}"] = got
                rows.append([f"round trip, gap {gap:g} ms", label, f"{got['median']:.0f}", f"{got['p90']:.0f}"])
    for awake, gap in ((False, 0.0), (False, COMPUTE_GAP_MS), (True, COMPUTE_GAP_MS)):
        label = "kept awake" if awake else "plain"
        with spinners(awake, seconds=120):
            got = summary(generate_calls(gap))
        figures[f"w1_generate_ms_gap_{gap:g}ms_{label.replace(' ', '_')}"] = got
        rows.append([f"W1 generate call (ms), gap {gap:g} ms", label, f"{got['median']:.2f}", f"{got['p90']:.2f}"])
    if args.pipeline_pairs:
        with tempfile.TemporaryDirectory(prefix="srl-wake-runs-") as runs:
            steps: dict[str, list[float]] = {}
            for k in (0, 1):
                for pair in range(args.pipeline_pairs):
                    for awake in (False, True):
                        label = f"k{k}_{'kept_awake' if awake else 'plain'}"
                        with spinners(awake, seconds=600):
                            ms = pipeline_ms_per_step(k, f"{runs}/{label}-{pair}")
                        steps.setdefault(label, []).append(ms)
            for label, values in steps.items():
                got = figures[f"w1_pipeline_ms_per_step_{label}"] = spread(values)
                rows.append([f"W1 pipeline ms a step, {label.split('_', 1)[0]}", label.split("_", 1)[1].replace("_", " "),
                             f"{got['median']:.2f}", f"[{got['min']:.2f}, {got['max']:.2f}]"])

    print(f"load average {os.getloadavg()[0]:.2f} (the spinners count in it while they run)")
    print_table(["measure", "cores", "median", "p90 / range"], rows)
    baseline = {"round_trip_us_back_to_back": figures["round_trip_us_gap_0.3ms_plain"],
                "w1_generate_ms_back_to_back": figures["w1_generate_ms_gap_0ms_plain"]}
    ratios = {
        "round_trip_gap_10ms_over_back_to_back":
            figures["round_trip_us_gap_10ms_plain"]["median"] / baseline["round_trip_us_back_to_back"]["median"],
        "round_trip_gap_10ms_kept_awake_over_back_to_back":
            figures["round_trip_us_gap_10ms_kept_awake"]["median"] / baseline["round_trip_us_back_to_back"]["median"],
        "w1_generate_gap_13ms_over_back_to_back":
            figures["w1_generate_ms_gap_13ms_plain"]["median"] / baseline["w1_generate_ms_back_to_back"]["median"],
    }
    print_json_line("idle_wakeups", figures, baseline, ratios, {"note": "no target: a property of the host"},
                    cpu_count=len(os.sched_getaffinity(0)), load_average=list(os.getloadavg()))


if __name__ == "__main__":
    main()
