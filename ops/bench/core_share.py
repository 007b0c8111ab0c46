#!/usr/bin/env python3
"""The host's core share (``resources.core_share``) against fixed threads per stage, side by side.

The same GRPO runs (ops/bench/grpo_vs_trl.py's W1 and W2, k = 0 and 1) under three settings,
alternating per repetition so that load drift hits all of them:

  fixed      the settings before the share: resources.core_share false, every worker's OpenMP
             waits passive (OMP_WAIT_POLICY=PASSIVE), generate on 1 thread in micro-batches of 64
             (train on 2), as pipelines/grpo.yaml had them; the baseline.
  shared-64  the share with the workers' short spin (the defaults), generate on up to 2 threads,
             still in micro-batches of 64: what the share alone gives.
  shared     the defaults: the share, generate on up to 2 threads in micro-batches of 128.

W2: completions/s (training time only, as in grpo_vs_trl). W1: milliseconds per step and steps
to mean reward 0.9 (the steps are the same under every setting unless float rounding moves them).
Last line: one JSON object.

    python ops/bench/core_share.py                  # W1 and W2, k = 0 and 1, 3 repetitions
    python ops/bench/core_share.py --workload W2 --reps 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt_spread, print_json_line, print_table, ratio, spread
from grpo_vs_trl import ROOT, streamrl_config

# name -> (`streamrl run` overrides, environment the run starts with)
SETTINGS: dict[str, tuple[list[str], dict[str, str]]] = {
    "fixed": (["resources.core_share=false", "stages.generate.threads=1", "stages.generate.micro_batch=64"],
              {"OMP_WAIT_POLICY": "PASSIVE"}),
    "shared-64": (["stages.generate.micro_batch=64"], {}),
    "shared": ([], {}),
}
TARGET = 1.0  # the share must not be slower than fixed threads on any of these runs


def run(workload: str, staleness: int, setting: str, seed: int, tmp: Path) -> dict[str, float]:
    overrides, env_extra = SETTINGS[setting]
    path = tmp / f"{workload}-k{staleness}-{setting}.yaml"
    path.write_text(yaml.safe_dump(streamrl_config(workload, seed, staleness, str(tmp / "runs"))))
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    proc = subprocess.run([sys.executable, "-m", "streamrl.cli", "run", str(path), *overrides, "--print-result"],
                          capture_output=True, text=True, timeout=900, cwd=ROOT, env={**env, **env_extra})
    if proc.returncode != 0:
        raise RuntimeError(f"{workload} k={staleness} {setting} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    steps = int(result["steps"])
    batch = 64 if workload == "W1" else 128
    return {"completions_per_s": steps * batch / result["train_s"], "ms_per_step": 1000 * result["train_s"] / steps,
            "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=["W1", "W2", "both"], default="both")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    workloads = ["W1", "W2"] if args.workload == "both" else [args.workload]
    cases = [(w, k) for w in workloads for k in (0, 1)]
    results: dict[str, list[dict[str, float]]] = {}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="streamrl-core-share-") as tmp:
        for rep in range(args.reps):
            for w, k in cases:
                for setting in SETTINGS:
                    r = run(w, k, setting, args.seed, Path(tmp))
                    results.setdefault(f"{w} k={k} {setting}", []).append(r)
                    print(f"rep {rep} {w} k={k} {setting:9s} {r['completions_per_s']:7.1f} completions/s "
                          f"{r['ms_per_step']:7.1f} ms/step  {r['steps']} steps  load {os.getloadavg()[0]:.2f}",
                          flush=True)
            load.append(os.getloadavg()[0])

    figures: dict[str, Any] = {}
    baseline: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    rows = []
    for w, k in cases:
        # W2: completions/s (higher is better); W1: ms per step (lower is better), so its ratio is fixed / shared
        metric = "completions_per_s" if w == "W2" else "ms_per_step"
        base = spread(r[metric] for r in results[f"{w} k={k} fixed"])
        baseline[f"{w}_k{k}_{metric}"] = base
        for setting in ("shared-64", "shared"):
            s = spread(r[metric] for r in results[f"{w} k={k} {setting}"])
            gain = ratio(s, base) if w == "W2" else ratio(base, s)
            figures[f"{w}_k{k}_{setting}_{metric}"] = s
            ratios[f"{w}_k{k}_{setting}"] = round(gain, 3)
            rows.append([f"{w} k={k}", metric, setting, fmt_spread(s), fmt_spread(base), f"{gain:.2f}"])
    print()
    print_table(["run", "figure", "setting", "median [min, max]", "fixed threads", "speed-up"], rows)
    print(f"load average {min(load):.2f} .. {max(load):.2f}")
    print_json_line("core_share", figures, baseline, ratios, {"speed_up_min": TARGET},
                    load_average=[min(load), max(load)], reps=args.reps)


if __name__ == "__main__":
    main()
