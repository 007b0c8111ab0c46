#!/usr/bin/env python3
"""Cheap stages chained on one claim against the same stages one per process: the W1 config
(``configs/grpo_digits.yaml``) on ``pipelines/grpo_chained.yaml`` against ``pipelines/grpo.yaml``
(``--family dapo``: preset dapo on ``pipelines/dapo_chained.yaml`` against ``pipelines/dapo.yaml``;
``--chain rollout``: ``pipelines/<family>_rollout.yaml``, generation chained too), alternating (the
order reversed every other pair), at ``algo.max_staleness`` 0 and 1.

Each run trains ``--steps`` steps with the stop reward off. Between steps ``--from`` and
``--to`` (the steady state: set-up and the first steps left out) it takes, from ``/proc``:

- ms a step (wall);
- CPU ms a step of every process of the run (the launcher's process tree);
- CPU ms a step around the compute: the same less the two processes that used the most CPU (the
  train and generate workers), i.e. the launcher, the dock, the source and the cheap stages.

The host's speed can drift by 2x within minutes (docs/benchmarks.md §27), so every figure is a
ratio within a pair, and the table gives the median and range of the ratios.

    python ops/bench/chained_stages.py --pairs 6

Last line: one JSON object. Target: the chained pipeline no slower (ms a step ratio <= 1.0).
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
from _common import fmt_spread, print_json_line, print_table, spread

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "grpo_digits.yaml"
FAMILIES = ("grpo", "dapo")  # pipelines/<family>.yaml against pipelines/<family>_<chain>.yaml
CHAINS = ("chained", "rollout")  # the cheap stages chained, or generation with them
FIGURES = ("ms a step", "CPU ms a step", "CPU ms a step around the compute")
TICK_S = 1 / os.sysconf("SC_CLK_TCK")
POLL_S = 0.02


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()  # after the command name, which may hold spaces


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(int(entry))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def counters(pids: list[int]) -> dict[int, tuple[float, int]]:
    """User + system CPU seconds and minor page faults (a page mapped on first touch) so far of each
    process still there, from one read of its ``/proc/PID/stat``."""
    out = {}
    for pid in pids:
        fields = _stat(pid)
        if fields is not None:
            out[pid] = ((int(fields[11]) + int(fields[12])) * TICK_S, int(fields[7]))
    return out


def last_step(run_root: Path, key: str = "step") -> float:
    """The newest value of ``key`` in the run's metrics.jsonl (the step by default; 0 before the first)."""
    for metrics in run_root.glob("*/metrics.jsonl"):
        for line in reversed(metrics.read_text().splitlines()):
            try:
                row = json.loads(line)
            except ValueError:  # a line being written
                continue
            if key in row:
                return float(row[key])
    return 0


def process_names(run_root: Path) -> dict[int, str]:
    """pid -> the run's name for it (its logs/pids.json: ``train-0``, ``launcher``, ``dock0`` the
    controller, ``dock1`` the warehouse)."""
    names: dict[int, str] = {}
    for pids in run_root.glob("*/logs/pids.json"):
        for key, value in json.loads(pids.read_text()).items():
            if key == "dock":
                names.update({pid: f"dock{j}" for j, pid in enumerate(value)})
            elif isinstance(value, int):
                names[value] = key
    return names


def measure_window(config: Path, overrides: list[str], window: tuple[int, int], timeout_s: float,
                   env: dict[str, str] | None = None,
                   per: str = "step") -> tuple[float, dict[int, float], dict[int, str], dict[int, float]]:
    """One ``streamrl run CONFIG OVERRIDES`` (quiet, no outputs beyond metrics) measured between
    steps ``window``: its ms a step, each process's CPU ms a step (by pid), the run's names for its
    processes, and each process's minor page faults a step. ``per``: another metric that counts
    up, e.g. ``source/groups_made``: each figure is then per unit of it over the window instead of
    per step."""
    with tempfile.TemporaryDirectory(prefix="cpu-window-") as tmp:
        run_root = Path(tmp) / "runs"
        proc = subprocess.Popen(
            [sys.executable, "-m", "streamrl.cli", "run", str(config), "algo.stop_reward=null",
             f"output.run_dir={run_root}", "output.progress=none", "output.tensorboard=false", "output.plot=false",
             "output.checkpoint=false", *overrides],  # the caller's last: they win
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp, env={**os.environ, **(env or {})})
        deadline = time.monotonic() + timeout_s
        snaps = []
        try:
            for target in window:
                while (step := last_step(run_root)) < target:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit(f"the run ({' '.join(overrides)}) ended or timed out at step {step} before "
                                         f"step {target} (exit {proc.returncode}); run it by hand to see why")
                    time.sleep(POLL_S)
                snaps.append((last_step(run_root, per), time.monotonic(), counters(process_tree(proc.pid))))
            names = process_names(run_root)
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    (s0, t0, c0), (s1, t1, c1) = snaps
    n = s1 - s0
    if n <= 0:
        raise SystemExit(f"{per} did not grow between steps {window[0]} and {window[1]}: nothing to divide by")
    both = [p for p in c1 if p in c0]
    return ((t1 - t0) * 1000 / n, {p: (c1[p][0] - c0[p][0]) * 1000 / n for p in both}, names,
            {p: (c1[p][1] - c0[p][1]) / n for p in both})


def one_run(pipeline: Path, preset: str, staleness: int, steps: int, window: tuple[int, int],
            timeout_s: float) -> dict[str, float]:
    wall, cpu, _, _ = measure_window(CONFIG, [f"pipeline={pipeline}", f"preset={preset}",
                                              f"algo.max_staleness={staleness}", f"algo.steps={steps}"],
                                     window, timeout_s)
    used = sorted(cpu.values(), reverse=True)
    return {"ms a step": wall, "CPU ms a step": sum(used), "CPU ms a step around the compute": sum(used[2:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=6, help="pairs of runs per staleness, alternating")
    ap.add_argument("--steps", type=int, default=260, help="steps of each run")
    ap.add_argument("--from", dest="first", type=int, default=30, help="the window's first step")
    ap.add_argument("--to", dest="last", type=int, default=230, help="the window's last step")
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 1], help="algo.max_staleness values")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds one run may take")
    ap.add_argument("--family", choices=FAMILIES, default="grpo", help="the pipelines (and preset) compared")
    ap.add_argument("--chain", choices=CHAINS, default="chained",
                    help="the chained pipeline: chained (the cheap stages) or rollout (generation too)")
    args = ap.parse_args()
    pipelines = {"default": ROOT / "pipelines" / f"{args.family}.yaml",
                 "chained": ROOT / "pipelines" / f"{args.family}_{args.chain}.yaml"}
    if args.pairs < 1 or not 0 < args.first < args.last <= args.steps:
        raise SystemExit("need --pairs >= 1 and 0 < --from < --to <= --steps")
    figures: dict[str, dict[str, dict[str, float]]] = {}
    baseline: dict[str, dict[str, dict[str, float]]] = {}
    ratios: dict[str, dict[str, dict[str, float]]] = {}
    for k in args.staleness:
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in pipelines}
        for pair in range(args.pairs):
            order = list(pipelines) if pair % 2 == 0 else list(reversed(pipelines))
            for name in order:
                load = os.getloadavg()[0]
                r = one_run(pipelines[name], args.family, k, args.steps, (args.first, args.last), args.timeout)
                runs[name].append(r)
                print(f"k={k} pair {pair} {name:8s} load {load:.2f}: "
                      + ", ".join(f"{f} {r[f]:.2f}" for f in FIGURES), flush=True)
        key = f"k={k}"
        figures[key] = {f: spread(r[f] for r in runs["chained"]) for f in FIGURES}
        baseline[key] = {f: spread(r[f] for r in runs["default"]) for f in FIGURES}
        ratios[key] = {f: spread(c[f] / d[f] for c, d in zip(runs["chained"], runs["default"], strict=True))
                       for f in FIGURES}
        print_table([f"k={k}, median [min, max]", "chained", "default", "chained ÷ default, per pair"],
                    [[f, fmt_spread(figures[key][f], 2), fmt_spread(baseline[key][f], 2),
                      fmt_spread(ratios[key][f], 3)] for f in FIGURES])
    name = f"chained_stages_{args.family}" + ("" if args.chain == "chained" else f"_{args.chain}")
    print_json_line(name, figures, baseline,
                    {key: {f: r[f]["median"] for f in FIGURES} for key, r in ratios.items()},
                    {"ms a step": "<= 1.0"}, pairs=args.pairs, window=[args.first, args.last],
                    met=all(r["ms a step"]["median"] <= 1.0 for r in ratios.values()))


if __name__ == "__main__":
    main()
