#!/usr/bin/env python3
"""Weight placements in the full pipeline: the GRPO digits run under each way weights reach generation.

    python ops/bench/placements.py [--reps 3] [--steps 40]

Each repetition runs ``--steps`` optimizer steps (stop_reward off) of the digits-max workload
(W1's model, task and batch) under every placement, interleaved:

- ``separate`` (baseline): one trainer process publishes a full CPU snapshot per version and the
  generator fetches it (``configs/grpo_digits.yaml`` on ``pipelines/grpo_rollout.yaml``);
- ``colocated`` T = 1 / T = 2: R = 2 processes alternate generate and train through the reshard
  and the swap (``configs/grpo_digits_colocated.yaml``);
- ``disaggregated`` T = 1 / T = 2: R = 2 train processes send each version bucket by bucket to 2
  generation processes (``configs/grpo_digits_disaggregated.yaml``).

Per run: median step time over the steps after the first 5 (start-up excluded), the weight path's
median ms per step (reshard + send or swap; for separate the trainer's publish is inside its step),
the peak extra bytes of a reshard and the bytes a train rank sends per version. The ratio printed is
step time against ``separate`` measured in the same repetition. There is no target: on 2 shared CPU
cores the reshard placements pay for 2 train ranks in lockstep and more processes than cores; the
point of them is memory (no full second copy) and device sharing, which such a machine cannot show.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt_spread, print_json_line, print_table, ratio, spread

import streamrl

REPO = Path(__file__).resolve().parents[2]
TP2 = ["stages.generate.options={tensor_parallel: 2}", "stages.generate.micro_batch=64"]
RUNS: dict[str, tuple[str, list[str]]] = {
    "separate": ("grpo_digits.yaml", [f"pipeline={REPO / 'pipelines' / 'grpo_rollout.yaml'}"]),
    "colocated T=1": ("grpo_digits_colocated.yaml", []),
    "colocated T=2": ("grpo_digits_colocated.yaml", TP2),
    "disaggregated T=1": ("grpo_digits_disaggregated.yaml", []),
    "disaggregated T=2": ("grpo_digits_disaggregated.yaml", TP2),
}


def _one(name: str, steps: int, seed: int, out: Path) -> dict[str, float]:
    config, extra = RUNS[name]
    result = streamrl.run(REPO / "configs" / config, [
        f"output.run_dir={out}", "output.progress=none", "output.tensorboard=false", "output.plot=false",
        "output.checkpoint=false", "algo.stop_reward=null", f"algo.steps={steps}", f"seed={seed}", *extra])
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()][5:]

    def med(key: str) -> float:
        values = [r[key] for r in rows if key in r]
        return statistics.median(values) if values else float("nan")

    return {
        "step_ms": med("step_time_s") * 1e3,
        "weights_ms": med("hand_over_ms") + (med("swap_in_ms") if "colocated" in name else 0.0)
        if "hand_over_ms" in rows[0] else float("nan"),
        "peak_extra_bytes": max((r.get("reshard_peak_extra_bytes", float("nan")) for r in rows), default=float("nan")),
        "sent_bytes": med("reshard_sent_bytes"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    results: dict[str, list[dict[str, float]]] = {name: [] for name in RUNS}
    with tempfile.TemporaryDirectory(prefix="bench-placements-") as tmp:
        for rep in range(args.reps):
            for name in RUNS:  # interleaved: load changes hit every placement alike
                results[name].append(_one(name, args.steps, rep, Path(tmp) / f"{rep}-{name.replace(' ', '_')}"))
                print(f"rep {rep} {name}: {results[name][-1]}", file=sys.stderr, flush=True)
    step = {name: spread(r["step_ms"] for r in runs) for name, runs in results.items()}
    rows: list[list[Any]] = []
    figures: dict[str, Any] = {}
    for name, runs in results.items():
        weights = spread(r["weights_ms"] for r in runs)
        peak = max(r["peak_extra_bytes"] for r in runs)
        sent = statistics.median(r["sent_bytes"] for r in runs)
        rows.append([name, fmt_spread(step[name]), f"{ratio(step[name], step['separate']):.2f}",
                     fmt_spread(weights), "-" if peak != peak else f"{peak / 2**10:.0f}",
                     "-" if sent != sent else f"{sent / 1e6:.2f}"])
        figures[name] = {"step_ms": step[name], "weights_ms": weights, "peak_extra_bytes": peak,
                         "sent_bytes_per_version": sent}
    print_table(["placement", "step ms", "vs separate", "weight path ms", "peak extra KiB", "sent MB/version"], rows)
    print_json_line("placements", figures, {"separate_step_ms": step["separate"]},
                    {name: ratio(step[name], step["separate"]) for name in RUNS if name != "separate"},
                    {"step_ms_vs_separate": None, "why": "CPU: memory and device sharing are what the reshard "
                                                                     "placements buy, not step time"})


if __name__ == "__main__":
    main()
