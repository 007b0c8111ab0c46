#!/usr/bin/env python3
"""Streaming overlap: 4 stages that take known times per micro-batch, run as separate processes
through the dock. Pipelined, throughput approaches 1/max(stage time); a batch-at-a-time
pipeline (every stage waits for the whole batch) gets 1/sum(stage times).

    python ops/bench/streaming_overlap.py [--reps 3] [--micro-batches 60]

Target: measured micro-batches/s >= 90% of 1/max(stage time). The baseline printed beside it is
the sequential rate 1/sum(stage times) that a non-streaming pipeline would get.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt_spread, print_json_line, print_table, spread

import streamrl

STAGE_S = [0.020, 0.030, 0.025, 0.015]  # seconds per micro-batch of each of the 4 stages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--micro-batches", type=int, default=60)
    ap.add_argument("--micro-batch", type=int, default=8, help="samples per micro-batch")
    args = ap.parse_args()
    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here))
    stages = [{"name": "source", "class": "overlap_stages:CountingSource", "writes": ["x0"],
               "options": {"micro_batches": args.micro_batches, "micro_batch": args.micro_batch}}]
    for i, t in enumerate(STAGE_S):
        stages.append({"name": f"s{i + 1}", "class": "overlap_stages:SleepStage", "reads": [f"x{i}"],
                       "writes": [f"x{i + 1}"] if i + 1 < len(STAGE_S) else [], "micro_batch": args.micro_batch,
                       "options": {"sleep_s": t}})
    rates = []
    with tempfile.TemporaryDirectory(prefix="srl-overlap-") as tmp:
        pipe = Path(tmp) / "overlap.yaml"
        pipe.write_text(yaml.safe_dump({"name": "overlap", "stages": stages}))
        # the worker processes import overlap_stages from this folder
        import os

        os.environ["PYTHONPATH"] = f"{here}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
        cfg = {"pipeline": str(pipe), "algo": {"steps": 1, "prompts_per_step": args.micro_batch, "group_size": 1,
                                                 "advantage": "dr_grpo"},
               "resources": {"dock": {"capacity": args.micro_batch * 8}},
               "output": {"run_dir": tmp, "name": "overlap", "tensorboard": False, "plot": False,
                          "checkpoint": False, "progress": "none"}}
        for _ in range(args.reps):
            result = streamrl.run(cfg)
            rates.append(args.micro_batches / result.train_s)
    ideal = 1.0 / max(STAGE_S)
    sequential = 1.0 / sum(STAGE_S)
    got = spread(rates)
    print_table(["measure", "micro-batches/s"], [
        ["streamrl, 4 stages pipelined (median [min, max])", fmt_spread(got, 1)],
        ["ideal pipelined rate 1/max(stage time)", f"{ideal:.1f}"],
        ["batch-at-a-time rate 1/sum(stage times)", f"{sequential:.1f}"],
    ])
    print(f"fraction of ideal: {got['median'] / ideal:.3f}")
    print_json_line("streaming_overlap", {"micro_batches_per_s": got, "stage_s": STAGE_S},
                    {"ideal_pipelined_per_s": ideal, "sequential_per_s": sequential},
                    {"fraction_of_ideal": got["median"] / ideal, "speedup_vs_sequential": got["median"] / sequential},
                    {"fraction_of_ideal": ">= 0.9"}, reps=args.reps, micro_batches=args.micro_batches)


if __name__ == "__main__":
    main()
