#!/usr/bin/env python3
"""Does any process grow over a long run? Resident memory of every process of one W2 run
(ops/bench/grpo_vs_trl.py's workload, synchronous) at chosen steps.

The run's processes come from its logs/pids.json; each one's VmRSS is read from /proc every
POLL_S, and the reading taken when metrics.jsonl first holds step s is kept for each s in
--at. A process that grows has a larger RSS at the later step; the table gives each process's
growth from the first to the last of them. The baseline is the process's own RSS at the first
step of --at: a leak is a change against it, not against another program.

    python ops/bench/rss_growth.py                     # 300 steps, RSS at steps 50 and 300
    python ops/bench/rss_growth.py --steps 100 --at 20,100

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_json_line, print_table, proc_status_mib
from grpo_vs_trl import ROOT, streamrl_config

POLL_S = 0.2


def watch(runs_dir: Path, at: list[int], out: dict[int, dict[str, float]], stop: threading.Event) -> None:
    """Fill ``out[step]`` with every process's RSS when metrics.jsonl first reaches ``step``."""
    while not stop.wait(POLL_S):
        for pids_path in glob.glob(str(runs_dir / "*" / "logs" / "pids.json")):
            run_dir = Path(pids_path).parents[1]
            try:
                pids = json.loads(Path(pids_path).read_text())
                steps = len((run_dir / "metrics.jsonl").read_text().splitlines())
            except (OSError, json.JSONDecodeError):
                continue
            roles = {k: v for k, v in pids.items() if isinstance(v, int)}
            roles.update({f"dock-{i}": p for i, p in enumerate(pids.get("dock", []))})
            now = {role: mib for role, pid in roles.items() if (mib := proc_status_mib(pid, "VmRSS")) is not None}
            if len(now) < len(roles):  # the run is ending (a process exited): not a reading of it running
                continue
            for step in at:
                if steps >= step and step not in out:
                    out[step] = now
            out[-1] = {**now, "_step": float(steps)}  # the latest full reading


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--at", default="50,300", help="steps at which to read every process's RSS")
    args = ap.parse_args()
    at = sorted(int(x) for x in args.at.split(","))
    if at[-1] > args.steps:
        raise SystemExit(f"--at {at[-1]} is past --steps {args.steps}")
    readings: dict[int, dict[str, float]] = {}
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        cfg: dict[str, Any] = streamrl_config("W2", 0, 0, str(tmp / "runs"))
        cfg["algo"]["steps"] = args.steps
        cfg["output"]["name"] = f"rss-W2-{args.steps}"
        path = tmp / "config.yaml"
        path.write_text(yaml.safe_dump(cfg))
        stop = threading.Event()
        poller = threading.Thread(target=watch, args=(tmp / "runs", at, readings, stop), daemon=True)
        poller.start()
        try:
            proc = subprocess.run([sys.executable, "-m", "streamrl.cli", "run", str(path), "--print-result"],
                                  capture_output=True, text=True, timeout=7200, cwd=ROOT)
        finally:
            stop.set()
            poller.join(5)
        if proc.returncode != 0:
            raise SystemExit(f"the run failed:\n{proc.stderr[-3000:]}")
    latest = readings.pop(-1, {})
    missing = [s for s in at if s not in readings]
    if missing and latest:  # the last step's reading races the processes' exit: the latest full one
        step = int(latest.pop("_step"))
        print(f"no reading at steps {missing} (the processes exited first): using the last full one, step {step}")
        readings[step] = latest
        at = sorted({*(s for s in at if s in readings), step})
    first, last = at[0], max((s for s in at if s in readings), default=at[0])
    rows, growth = [], {}
    for role in sorted(readings.get(first, {})):
        values = [readings[s].get(role) for s in at if s in readings]
        a, b = readings[first].get(role), readings.get(last, {}).get(role)
        growth[role] = round(b - a, 1) if a is not None and b is not None else None
        rows.append([role, *[f"{v:.0f}" if v is not None else "-" for v in values],
                     f"{growth[role]:+.1f}" if growth[role] is not None else "-"])
    print(f"W2, {args.steps} steps; load {load0:.2f} -> {os.getloadavg()[0]:.2f}")
    print_table(["process", *[f"RSS MiB at step {s}" for s in at if s in readings], f"growth {first}->{last}"], rows)
    print_json_line("rss_growth", {"steps": args.steps, "rss_mib": {str(k): v for k, v in readings.items()},
                                   "growth_mib": growth},
                    baseline={"rss_at_step": first}, ratio={},
                    target={"growth": "none: no process grows between the steps"})


if __name__ == "__main__":
    main()
