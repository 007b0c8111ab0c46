#!/usr/bin/env python3
"""How cost grows with the model and the batch: streamrl and TRL's GRPOTrainer side by side on one
grid, in one run.

The pipeline of ops/bench/grpo_vs_trl.py's W2 (synchronous GRPO on the run's default pipeline,
``auto``: pipelines/grpo_sync.yaml at max_staleness 0, or another with --streamrl-set pipeline=...;
the same optimizer, sampling and loss on both sides) on digits-reverse
(2-12 digits, up to 16 tokens), at four model sizes (tiny Qwen2, intermediate 2 x hidden, head
size 64 or 4 heads) and three batch sizes (4, 8, 16 prompts x 8 completions), STEPS steps each,
seed 0. Figures per cell:

- completions/s over steps 2..STEPS (the first carries warm-up on both sides; TRL's
  ``steady_completions_per_s``);
- useful FLOP/s (training 6 x params x sequence tokens + generation 2 x params x the same, as in
  grpo_vs_trl.py) as a fraction of the fp32 matmul ceiling measured in this run, and the executed
  fraction: the same count with each prompt's tokens once per group, as streamrl computes them;
- peak resident memory (VmHWM) of every streamrl process, read from /proc every POLL_S while
  the run goes (the processes come from the run's logs/pids.json), and TRL's one process;
- the trainer's estimate: the resident size of a worker without a model (the source stage:
  Python, torch, the dock client, the task and its tokenizer) + parameters, gradients and AdamW's
  two moments (16 bytes a parameter, fp32) + the published policy versions (8 bytes a parameter:
  the newest version's file in the run's shared memory, which generation maps while the trainer
  goes on, and the next one's, allocated ahead; streamrl.runtime.policy) + the largest
  micro-batch's activations
  (ACT_BYTES_PER_TOKEN_LAYER_HIDDEN bytes per token, layer and channel, a budget for a block's
  saved tensors in fp32 without activation checkpointing; the tokens of the step with the most,
  per micro-batch, since the peak comes with the largest one); the trainer's peak over it.

    python ops/bench/cost_growth.py                   # the whole grid, both sides
    python ops/bench/cost_growth.py --sizes 3M,25M --batches 64 --skip-trl
    python ops/bench/cost_growth.py --skip-trl --mmap-threshold 1048576   # the trainer's option of that name
    python ops/bench/cost_growth.py --sizes 3M,25M --batches 64 --streamrl-set model.matmul_precision=medium

Last line: one JSON object (every cell's figures; ratio = streamrl / TRL completions/s).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_json_line, print_table, proc_status_mib
from grpo_vs_trl import (
    DEFAULT_TRL_VENV,
    ROOT,
    TRL_RUNNER,
    ensure_trl_venv,
    gflops,
    matmul_ceiling_gflops,
    streamrl_config,
)

SIZES: dict[str, tuple[int, int]] = {"0.4M": (128, 2), "3M": (256, 4), "25M": (512, 8), "100M": (1024, 10)}
BATCHES = (32, 64, 128)  # completions per step: 4, 8, 16 prompts x 8
GROUP = 8
STEPS = 4
MAX_NEW_TOKENS = 16
POLL_S = 0.05
ACT_BYTES_PER_TOKEN_LAYER_HIDDEN = 64  # fp32: about 16 saved tensors of `hidden` floats per token and layer
# the policy publisher's fp32 versions in the run's shared memory: the newest one's file and the next
# one's, allocated and populated ahead while training goes on (streamrl/runtime/policy.py), both
# resident in the trainer (its pages)
PUBLISHED_BYTES_PER_PARAM = 8


def shape(size: str) -> dict[str, int]:
    hidden, layers = SIZES[size]
    return {"hidden": hidden, "layers": layers, "heads": max(4, hidden // 64), "intermediate": 2 * hidden}


def params_of(size: str) -> int:
    from streamrl.models.build import TinyModelSpec, build_model
    from streamrl.models.tokenizer import build_char_tokenizer

    model = build_model(TinyModelSpec(**shape(size), seed=0), build_char_tokenizer())
    return sum(p.numel() for p in model.parameters())


def init_sha(size: str) -> str:
    from trl_grpo import weights_sha256

    from streamrl.models.build import TinyModelSpec, build_model
    from streamrl.models.tokenizer import build_char_tokenizer

    return weights_sha256(build_model(TinyModelSpec(**shape(size), seed=0), build_char_tokenizer()))


class PeakWatch:
    """Polls the processes a run lists in logs/pids.json and keeps each one's peak RSS."""

    def __init__(self, runs_dir: Path) -> None:
        self.runs_dir, self.peak = runs_dir, {}  # role -> MiB
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> PeakWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            for path in glob.glob(str(self.runs_dir / "*" / "logs" / "pids.json")):
                try:
                    pids = json.loads(Path(path).read_text())
                except (OSError, json.JSONDecodeError):
                    continue
                roles = {k: v for k, v in pids.items() if isinstance(v, int)}
                roles.update({f"dock-{i}": p for i, p in enumerate(pids.get("dock", []))})
                for role, pid in roles.items():
                    mib = proc_status_mib(pid, "VmHWM")
                    if mib is not None:
                        self.peak[role] = max(self.peak.get(role, 0.0), mib)


def run_streamrl(size: str, batch: int, tmp: Path, mmap_threshold: int | None = None,
                 overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """One cell's streamrl run; ``overrides``: its command line's field overrides (``--streamrl-set``)."""
    cfg = streamrl_config("W2", 0, 0, str(tmp / "runs"))
    if mmap_threshold is not None:
        cfg["stages"] = {"train": {"options": {"mmap_threshold_bytes": mmap_threshold}}}
    cfg["model"] = {"tiny": {**shape(size), "seed": 0}}
    cfg["task"] = {"name": "digits-reverse", "options": {"min_digits": 2, "max_digits": 12}, "seed": 0}
    cfg["algo"] = {"steps": STEPS, "prompts_per_step": batch // GROUP, "group_size": GROUP,
                   "max_new_tokens": MAX_NEW_TOKENS, "lr": 1e-3, "max_staleness": 0}
    cfg["output"]["name"] = f"cost-{size}-{batch}"
    path = tmp / f"cost-{size}-{batch}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with PeakWatch(tmp / "runs") as watch:
        proc = subprocess.run([sys.executable, "-m", "streamrl.cli", "run", str(path), *overrides, "--print-result"],
                              capture_output=True, text=True, timeout=1800, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"streamrl {size} x {batch} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = [json.loads(x) for x in (Path(result["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    micro = yaml.safe_load((Path(result["run_dir"]) / "pipeline.yaml").read_text())
    train_mb = next(s.get("micro_batch", 16) for s in micro["stages"] if s["name"] == "train")
    shutil.rmtree(tmp / "runs", ignore_errors=True)  # this cell's run dir: the next cell polls its own
    steady = [r["step_time_s"] for r in rows[1:]]  # step 1 carries warm-up (as TRL's steady figure)
    return {"completions_per_s": len(steady) * batch / sum(steady), "train_s": sum(steady),
            "sequence_tokens": sum(r["sequence_tokens"] for r in rows[1:]),
            "prompt_tokens": sum(r["sequence_tokens"] - r["response_tokens"] for r in rows[1:]),
            "peak_rss_mib": watch.peak,
            "train_micro_batch": train_mb, "largest_step_tokens": max(r["sequence_tokens"] for r in rows)}


def run_trl(python: Path, size: str, batch: int) -> dict[str, Any]:
    s = shape(size)
    args = ["--task", "reverse", "--n-digits", "12", "--min-digits", "2", "--max-completion-length",
            str(MAX_NEW_TOKENS), "--prompts-per-step", str(batch // GROUP), "--num-generations", str(GROUP),
            "--steps", str(STEPS), "--lr", "1e-3", "--seed", "0", "--print-every", "0",
            *[x for k, v in s.items() for x in (f"--{k}", str(v))]]
    proc = subprocess.run([str(python), str(TRL_RUNNER), *args], capture_output=True, text=True, timeout=3600)
    line = next((x for x in reversed(proc.stdout.splitlines()) if x.startswith("RESULT_JSON")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"TRL {size} x {batch} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(line.split(" ", 1)[1])
    if result["model"]["init_weights_sha256"] != init_sha(size):
        raise RuntimeError(f"TRL {size} started from other weights than streamrl: remake its venv")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=",".join(SIZES))
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--streamrl-set", action="append", default=[], metavar="FIELD=VALUE",
                    help="a field override of every streamrl run (repeatable), e.g. model.matmul_precision=medium; "
                         "the TRL side runs as it is")
    ap.add_argument("--mmap-threshold", type=int, default=None,
                    help="bytes: the train stage's options.mmap_threshold_bytes (default: unset, glibc's own)")
    ap.add_argument("--trl-venv", type=Path, default=DEFAULT_TRL_VENV)
    args = ap.parse_args()
    sizes = args.sizes.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    python = None if args.skip_trl else ensure_trl_venv(args.trl_venv)
    ceiling = matmul_ceiling_gflops()
    load0 = os.getloadavg()[0]
    cells: dict[str, dict[str, Any]] = {}
    table = []
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        for size in sizes:
            params = params_of(size)
            hidden, layers = SIZES[size]
            for batch in batches:
                ours = run_streamrl(size, batch, tmp, args.mmap_threshold, tuple(args.streamrl_set))
                theirs = run_trl(python, size, batch) if python is not None else None
                useful, executed = gflops(params, ours["sequence_tokens"], ours["prompt_tokens"], ours["train_s"],
                                          GROUP)
                peaks = ours["peak_rss_mib"]
                # a worker without a model: the source (the sync and rollout pipelines chain advantages
                # into the train or rollout worker, so no advantage stage runs apart)
                if "source-0" not in peaks:
                    raise RuntimeError(f"{size} x {batch}: no peak RSS was read for the source stage (read: "
                                       f"{sorted(peaks)}); the trainer's estimate needs it")
                base = peaks["source-0"]
                # the largest step's tokens per micro-batch: sampled lengths vary, so the steps do
                tokens_mb = ours["largest_step_tokens"] / batch * min(ours["train_micro_batch"], batch)
                activations = ACT_BYTES_PER_TOKEN_LAYER_HIDDEN * tokens_mb * layers * hidden
                estimate = base + ((16 + PUBLISHED_BYTES_PER_PARAM) * params + activations) / 2**20
                cell = {"params": params, "completions_per_s": round(ours["completions_per_s"], 2),
                        "flop_fraction": round(useful / ceiling, 3),
                        "executed_flop_fraction": round(executed / ceiling, 3), "peak_rss_mib": {k: round(v) for k, v in peaks.items()},
                        "trainer_estimate_mib": round(estimate), "trainer_over_estimate": round(
                            peaks.get("train-0", 0.0) / estimate, 2) if estimate else None}
                if theirs is not None:
                    cell["trl_completions_per_s"] = theirs["steady_completions_per_s"]
                    cell["trl_peak_rss_mib"] = theirs.get("peak_rss_mib")
                    cell["ratio"] = round(ours["completions_per_s"] / theirs["steady_completions_per_s"], 2)
                cells[f"{size}x{batch}"] = cell
                table.append([size, batch, f"{cell['completions_per_s']:.1f}",
                              f"{cell.get('trl_completions_per_s', '-')}", f"{cell.get('ratio', '-')}",
                              f"{cell['flop_fraction']:.2f} / {cell['executed_flop_fraction']:.2f}",
                              " ".join(f"{k.split('-')[0]} {v}" for k, v in sorted(cell["peak_rss_mib"].items())),
                              f"{cell.get('trl_peak_rss_mib', '-')}", f"{cell['trainer_estimate_mib']} "
                              f"({cell['trainer_over_estimate']}x)"])
                print(f"{size} x {batch} done (load {os.getloadavg()[0]:.1f})", flush=True)
    print(f"\nfp32 matmul ceiling {ceiling:.0f} GFLOP/s; load {load0:.2f} -> {os.getloadavg()[0]:.2f}")
    print_table(["model", "batch", "streamrl c/s", "TRL c/s", "ratio", "ceiling frac (useful / executed)", "streamrl peak RSS MiB",
                 "TRL RSS MiB", "trainer estimate MiB (peak/est)"], table)
    print_json_line("cost_growth", {"cells": cells, "ceiling_gflops": ceiling,
                                    "train_mmap_threshold_bytes": args.mmap_threshold,
                                    "streamrl_set": args.streamrl_set or None}, baseline={"side": "TRL GRPOTrainer"},
                    ratio={k: v.get("ratio") for k, v in cells.items()},
                    target={"trainer_over_estimate": "<= 1.3", "ratio": ">= 1.8 at k=0"})


if __name__ == "__main__":
    main()
