#!/usr/bin/env python3
"""CPU ms a step of each process of one run, this checkout against another (``--against``),
alternating: which process a change makes cheaper, where the step time cannot show it (the
host's speed drifts by 2x within minutes, docs/benchmarks.md §27).

Each run is ``configs/grpo_digits.yaml`` (W1) on ``--pipeline`` with ``--set`` overrides, the stop
reward off; between steps ``--from`` and ``--to`` it reads every process's CPU from
``/proc/PID/stat`` and names them from the run's ``logs/pids.json`` (``train-0``, ``dock0`` the
controller, ``dock1`` the warehouse, ``launcher``).

    git worktree add /tmp/before COMMIT
    python ops/bench/cpu_per_step.py --against /tmp/before --pipeline pipelines/dapo.yaml \\
        --set preset=dapo --set algo.max_staleness=0 --from 20 --to 90 --pairs 4

Last line: one JSON object (per process, median CPU ms a step, this checkout and the other; no
target: a breakdown).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import checkout_env, fmt_spread, print_json_line, print_table, spread
from chained_stages import POLL_S, cpu_seconds, last_step, process_tree

ROOT = Path(__file__).resolve().parents[2]


def process_names(run_root: Path) -> dict[int, str]:
    """pid -> the run's name for it (logs/pids.json)."""
    names: dict[int, str] = {}
    for pids in run_root.glob("*/logs/pids.json"):
        for key, value in json.loads(pids.read_text()).items():
            if key == "dock":
                names.update({pid: f"dock{j}" for j, pid in enumerate(value)})
            elif isinstance(value, int):
                names[value] = key
    return names


def one_run(config: Path, pipeline: Path, sets: list[str], window: tuple[int, int], env: dict[str, str],
            timeout_s: float) -> dict[str, float]:
    """CPU ms a step of each named process over the window, and the run's ms a step ("wall")."""
    with tempfile.TemporaryDirectory(prefix="cpu-per-step-") as tmp:
        run_root = Path(tmp) / "runs"
        proc = subprocess.Popen(
            [sys.executable, "-m", "streamrl.cli", "run", str(config), f"pipeline={pipeline}",
             f"algo.steps={window[1] + 30}", "algo.stop_reward=null", f"output.run_dir={run_root}",
             "output.progress=none", "output.tensorboard=false", "output.plot=false", "output.checkpoint=false",
             *sets],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp, env={**os.environ, **env})
        deadline = time.monotonic() + timeout_s
        snaps = []
        try:
            for target in window:
                while (step := last_step(run_root)) < target:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit(f"the run ended or timed out at step {step} before step {target} "
                                         f"(exit {proc.returncode}); run it by hand to see why")
                    time.sleep(POLL_S)
                snaps.append((step, time.monotonic(), cpu_seconds(process_tree(proc.pid))))
            names = process_names(run_root)
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    (s0, t0, cpu0), (s1, t1, cpu1) = snaps
    n = s1 - s0
    out = {"wall": (t1 - t0) * 1000 / n}
    for pid, seconds in cpu1.items():
        if pid in cpu0 and pid in names:
            out[names[pid]] = (seconds - cpu0[pid]) * 1000 / n
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", type=Path, required=True, help="the other checkout's root (a git worktree)")
    ap.add_argument("--pipeline", default="pipelines/grpo.yaml", help="relative to each checkout")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="FIELD=VALUE",
                    help="a run config override (repeatable)")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--from", dest="first", type=int, default=30)
    ap.add_argument("--to", dest="last", type=int, default=230)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds one run may take")
    args = ap.parse_args()
    if args.pairs < 1 or not 0 < args.first < args.last:
        raise SystemExit("need --pairs >= 1 and 0 < --from < --to")
    checkouts = {"this": (ROOT, {"PYTHONPATH": str(ROOT)}),
                 "against": (args.against.resolve(), checkout_env(args.against))}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in checkouts}
    for pair in range(args.pairs):
        for name in (list(checkouts) if pair % 2 == 0 else list(reversed(checkouts))):
            root, env = checkouts[name]
            load = os.getloadavg()[0]
            r = one_run(root / "configs" / "grpo_digits.yaml", root / args.pipeline, args.sets,
                        (args.first, args.last), env, args.timeout)
            runs[name].append(r)
            print(f"pair {pair} {name:7s} load {load:.2f}: " + ", ".join(f"{k} {v:.1f}" for k, v in r.items()),
                  flush=True)
    keys = sorted({k for rs in runs.values() for r in rs for k in r}, key=lambda k: (k != "wall", k))
    figures = {name: {k: spread(r[k] for r in rs if k in r) for k in keys} for name, rs in runs.items()}
    print_table(["ms a step (wall) / CPU ms a step, median [min, max]", "this checkout", f"against {args.against}"],
                [[k, fmt_spread(figures["this"][k]), fmt_spread(figures["against"][k])] for k in keys])
    print_json_line("cpu_per_step", figures["this"], figures["against"],
                    {k: figures["this"][k]["median"] / figures["against"][k]["median"]
                     for k in keys if figures["against"][k]["median"]},
                    {}, pipeline=args.pipeline, sets=args.sets, pairs=args.pairs, window=[args.first, args.last])


if __name__ == "__main__":
    main()
