#!/usr/bin/env python3
"""CPU ms a step of each process of one run, this checkout against another (``--against``),
alternating: which process a change makes cheaper, where the step time cannot show it (the
host's speed drifts by 2x within minutes, docs/benchmarks.md §27).

Each run is ``configs/grpo_digits.yaml`` (W1), or with ``--workload W2`` ops/bench/grpo_vs_trl.py's
W2 config (seed 0), on ``--pipeline`` with ``--set`` overrides, the stop reward off; between steps
``--from`` and ``--to`` it reads every process's CPU (and with ``--faults`` its minor page faults:
pages mapped on first touch, each zero-filled by the kernel) from ``/proc/PID/stat`` and names them
from the run's ``logs/pids.json`` (``train-0``, ``dock0`` the controller, ``dock1`` the warehouse,
``launcher``).

    git worktree add /tmp/before COMMIT
    python ops/bench/cpu_per_step.py --against /tmp/before --pipeline pipelines/dapo.yaml \\
        --set preset=dapo --set algo.max_staleness=0 --from 20 --to 90 --pairs 4

W2 at k=1, page faults too (docs/benchmarks.md §44):

    python ops/bench/cpu_per_step.py --against /tmp/before --workload W2 --pipeline pipelines/grpo_rollout.yaml \
        --set algo.max_staleness=1 --from 10 --to 35 --pairs 3 --faults

With dynamic sampling at ``max_staleness`` > 0 the groups made a step vary with the policy's
trajectory, which differs from run to run: ``--per source/groups_made`` divides by the groups the
source made over the window instead of the steps.

Last line: one JSON object (per process, median CPU ms a step, this checkout and the other; no
target: a breakdown).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import checkout_env, fmt_spread, print_json_line, print_table, spread
from chained_stages import measure_window

ROOT = Path(__file__).resolve().parents[2]


def one_run(config: Path, pipeline: Path, sets: list[str], window: tuple[int, int], env: dict[str, str],
            timeout_s: float, per: str = "step", faults: bool = False) -> dict[str, float]:
    """CPU ms a step (or a unit of ``per``) of each named process over the window, the run's ms a
    step ("wall"), and with ``faults`` each named process's minor page faults a step ("NAME faults")."""
    wall, cpu, names, minflt = measure_window(config, [f"pipeline={pipeline}", f"algo.steps={window[1] + 30}",
                                                       *sets], window, timeout_s, env, per)
    figures = {"wall": wall, **{names[pid]: ms for pid, ms in cpu.items() if pid in names}}
    if faults:
        figures.update({f"{names[pid]} faults": n for pid, n in minflt.items() if pid in names})
    return figures


def w2_config(directory: Path) -> Path:
    """ops/bench/grpo_vs_trl.py's W2 config (seed 0, k=0: ``--set`` overrides change it) as a file."""
    from grpo_vs_trl import streamrl_config

    path = directory / "w2.yaml"
    path.write_text(yaml.safe_dump(streamrl_config("W2", 0, 0, str(directory / "runs"))))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", type=Path, required=True, help="the other checkout's root (a git worktree)")
    ap.add_argument("--pipeline", default="pipelines/grpo.yaml", help="relative to each checkout")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="FIELD=VALUE",
                    help="a run config override (repeatable)")
    ap.add_argument("--workload", choices=["W1", "W2"], default="W1",
                    help="W1: configs/grpo_digits.yaml of each checkout; W2: grpo_vs_trl.py's W2 config")
    ap.add_argument("--faults", action="store_true", help="each process's minor page faults a step too")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--from", dest="first", type=int, default=30)
    ap.add_argument("--to", dest="last", type=int, default=230)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds one run may take")
    ap.add_argument("--per", default="step", help="divide by this metric's growth over the window instead of "
                    "the steps, e.g. source/groups_made: dynamic sampling's work per step varies with the "
                    "policy's trajectory at max_staleness > 0")
    args = ap.parse_args()
    if args.pairs < 1 or not 0 < args.first < args.last:
        raise SystemExit("need --pairs >= 1 and 0 < --from < --to")
    checkouts = {"this": (ROOT, {"PYTHONPATH": str(ROOT)}),
                 "against": (args.against.resolve(), checkout_env(args.against))}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in checkouts}
    with tempfile.TemporaryDirectory(prefix="cpu-per-step-") as tmp:  # removed also when a run fails
        w2 = w2_config(Path(tmp)) if args.workload == "W2" else None  # the same file for both checkouts
        for pair in range(args.pairs):
            for name in (list(checkouts) if pair % 2 == 0 else list(reversed(checkouts))):
                root, env = checkouts[name]
                load = os.getloadavg()[0]
                config = w2 or root / "configs" / "grpo_digits.yaml"
                r = one_run(config, root / args.pipeline, args.sets, (args.first, args.last), env, args.timeout,
                            args.per, args.faults)
                runs[name].append(r)
                print(f"pair {pair} {name:7s} load {load:.2f}: " + ", ".join(f"{k} {v:.1f}" for k, v in r.items()),
                      flush=True)
    keys = sorted({k for rs in runs.values() for r in rs for k in r}, key=lambda k: (k != "wall", k))
    figures = {name: {k: spread(r[k] for r in rs if k in r) for k in keys} for name, rs in runs.items()}
    print_table([f"ms a {args.per} (wall) / CPU ms a {args.per}, median [min, max]", "this checkout", f"against {args.against}"],
                [[k, fmt_spread(figures["this"][k]), fmt_spread(figures["against"][k])] for k in keys])
    print_json_line("cpu_per_step", figures["this"], figures["against"],
                    {k: figures["this"][k]["median"] / figures["against"][k]["median"]
                     for k in keys if figures["against"][k]["median"]},
                    {}, pipeline=args.pipeline, sets=args.sets, pairs=args.pairs, window=[args.first, args.last],
                    per=args.per, workload=args.workload)


if __name__ == "__main__":
    main()
