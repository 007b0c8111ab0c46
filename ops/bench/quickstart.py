#!/usr/bin/env python3
"""The quickstart's wall time, start-up and end included: ``streamrl run configs/grpo_digits.yaml``
as a user types it, this checkout against another (``--against``, e.g. a git worktree of an older
commit), repetitions alternating.

Each repetition is a fresh command (a fresh interpreter and forkserver: only the OS's page cache
is warm) with ``--print-result``, and gives:

- exit: from the start until the command exits (what ``time streamrl run ...`` shows);
- output closed: until its stdout reaches end-of-file, i.e. until every process holding it is gone
  (what ``streamrl run ... | tee log`` waits for);
- before launch: the command's start-up before the launcher's clock starts, and its exit after the
  result (exit - total);
- setup: launch until every worker is set up (the run's ``setup_s``); training: Go until the end of
  training (``train_s``); end: stopping the processes, the reward curve, the trace (total - setup -
  training).

    git worktree add /tmp/old COMMIT
    python ops/bench/quickstart.py --against /tmp/old --reps 5

Last line: one JSON object. Target: the command's exit within 15 s (issue 24).
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
from _common import checkout_env, fmt_spread, print_json_line, print_table, ratio, spread

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = Path("configs") / "grpo_digits.yaml"  # each checkout's own
TARGET_S = 15.0
FIGURES = ("exit", "output closed", "before launch", "setup", "training", "end")


def one_run(config: Path, env: dict[str, str], timeout_s: float) -> dict[str, float]:
    """One ``streamrl run`` of a checkout's quickstart ``config`` in a temp directory; its figures in seconds."""
    with tempfile.TemporaryDirectory(prefix="quickstart-") as tmp:
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "streamrl.cli", "run", str(config), f"output.run_dir={tmp}/run",
                                 "output.progress=none", "--print-result"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=tmp, env={**os.environ, **env})
        try:
            returncode = proc.wait(timeout=timeout_s)  # the output is one line: the pipe cannot fill
            t_exit = time.monotonic()
            assert proc.stdout is not None
            out = proc.stdout.read()  # returns at end-of-file: once no process holds the pipe
            t_closed = time.monotonic()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
            if proc.stdout is not None:
                proc.stdout.close()
        if returncode != 0:
            raise SystemExit(f"streamrl run exited {returncode} (env {env}); run it by hand to see why")
        r = json.loads(out.decode().strip().splitlines()[-1])
    exit_s = t_exit - t0
    return {"exit": exit_s, "output closed": t_closed - t0, "before launch": exit_s - r["total_s"],
            "setup": r["setup_s"], "training": r["train_s"], "end": r["total_s"] - r["setup_s"] - r["train_s"],
            "steps": r["steps"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", type=Path, required=True,
                    help="the other checkout's root (e.g. a git worktree of an older commit)")
    ap.add_argument("--reps", type=int, default=5, help="runs of each checkout, alternating")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds one run may take")
    args = ap.parse_args()
    if args.reps < 1:
        raise SystemExit("--reps must be >= 1")
    checkouts = {"this": {"PYTHONPATH": str(ROOT)}, "against": checkout_env(args.against)}
    configs = {"this": ROOT / QUICKSTART, "against": args.against.resolve() / QUICKSTART}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in checkouts}
    for rep in range(args.reps):
        for name, env in checkouts.items():
            load = os.getloadavg()[0]
            r = one_run(configs[name], env, args.timeout)
            runs[name].append(r)
            print(f"rep {rep} {name:7s} load {load:.2f}: " + ", ".join(f"{k} {r[k]:.2f}" for k in FIGURES)
                  + f" s ({r['steps']:.0f} steps)", flush=True)
    figures = {name: {k: spread(r[k] for r in rs) for k in FIGURES} for name, rs in runs.items()}
    print_table(["seconds, median [min, max]", "this checkout", f"against {args.against}"],
                [[k, fmt_spread(figures["this"][k], 2), fmt_spread(figures["against"][k], 2)] for k in FIGURES])
    print_json_line("quickstart", figures["this"], figures["against"],
                    {k: ratio(figures["this"][k], figures["against"][k]) for k in FIGURES},
                    {"exit": f"<= {TARGET_S} s"}, against=str(args.against), reps=args.reps,
                    met=figures["this"]["exit"]["median"] <= TARGET_S)


if __name__ == "__main__":
    main()
