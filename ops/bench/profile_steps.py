#!/usr/bin/env python3
"""Where a GRPO run's time goes: every process of one streamrl run sampled by py-spy, each sample
put in a phase, side by side with the run's own step figures.

Workloads are those of ops/bench/grpo_vs_trl.py (W1, W2) and a third shape, W3: a wider model
(hidden 384, 6 layers) on digits-reverse with 32 prompts x 4 samples and up to 16 tokens, 10
steps: more parameters per generated token than W2, fewer samples per prompt.

The run is started under ``py-spy record --subprocesses`` (pip install py-spy; it samples every
worker process the launcher spawns). A sample is active time of one thread (py-spy leaves out
threads that sleep), so a process's samples / rate is its busy CPU seconds, and wall - busy is
time it waited. Each sample is put in the first phase whose frame pattern matches, scanning from
the innermost frame out (PHASES). Each process is named after the stage module that appears most
in its samples (launcher, dock controller, warehouse otherwise).

    python ops/bench/profile_steps.py --workload W2            # k=0, seed 0
    python ops/bench/profile_steps.py --workload W1 --staleness 1 --rate 200

Tables: per process, its busy seconds and their split over phases, per optimizer step; then the
trainer's own step figures (metrics.jsonl: step time, train, hand-over, waits). Last line: one
JSON object (the phases per process, seconds per step).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_json_line, print_table
from grpo_vs_trl import ROOT, streamrl_config

# phase -> frame patterns (regular expressions on "function (file:line)"); the first phase with a
# pattern matching a frame, from the innermost frame out, takes the sample
PHASES: list[tuple[str, tuple[str, ...]]] = [
    ("import / start-up", (r"<frozen importlib", r"^_find_and_load", r"forkserver")),
    ("gen prefill", (r"^\w*\.?prefill \(streamrl/engines/",)),
    ("gen sampling", (r"^sample_tokens \(streamrl/engines/rollout", r"^\w*\._sample \(streamrl/engines/rollout")),
    ("gen decode", (r"^\w*\.?step \(streamrl/engines/rollout", r"_sample_loop \(streamrl/engines/rollout")),
    ("weights install", (r"load_weights \(streamrl/", r"load_state_dict \(streamrl/engines/rollout")),
    ("weights fetch", (r"streamrl/runtime/policy\.py",)),
    ("weights publish", (r"publish \(streamrl/stages/handover", r"export_state|full_state_dict")),
    ("train backward", (r"^backward \(torch/", r"^_engine_run_backward", r"run_backward")),
    ("logprob pass", (r"^FSDPTrainEngine\.logprobs ", r"streamrl/engines/logprob\.py")),
    ("optimizer step", (r"\.step \(streamrl/engines/fsdp", r"clip_grad", r"optim/adamw")),
    ("train forward", (r"^FSDPTrainEngine\.(accumulate|_response_logprobs) ",)),
    ("collectives", (r"torch/distributed/distributed_c10d",)),
    ("reward", (r"streamrl/rewards/", r"streamrl/tasks/rewards", r"streamrl/tasks/digits")),
    ("model build", (r"build_policy \(streamrl", r"build_model \(streamrl", r"setup \(streamrl/stages/")),
    ("dock client", (r"streamrl/dock/client\.py",)),
    ("dock codec", (r"streamrl/dock/codec\.py",)),
    ("dock server", (r"streamrl/dock/(warehouse|controller|state)\.py",)),
    ("metrics", (r"streamrl/metrics/",)),
    ("asyncio (Python)", (r"asyncio/", r"anyio/")),
]
# the innermost frame of a thread waiting in its event loop's poll (py-spy counts it busy while it
# returns from the poll and runs callbacks): counted apart, as loop overhead
LOOP_POLL = re.compile(r"(select|poll) \(selectors\.py|_run_once \(")
COMPILED = [(name, [re.compile(p) for p in pats]) for name, pats in PHASES]
ROLE_OF_MODULE = re.compile(r"\((streamrl/stages/\w+)\.py")
W3: dict[str, Any] = {"model": {"tiny": {"hidden": 384, "layers": 6, "heads": 6, "intermediate": 768}},
                      "task": {"name": "digits-reverse", "options": {"min_digits": 2, "max_digits": 12}},
                      "algo": {"steps": 10, "prompts_per_step": 32, "group_size": 4, "max_new_tokens": 16, "lr": 1e-3}}


def config(workload: str, seed: int, staleness: int, run_dir: str) -> dict[str, Any]:
    if workload != "W3":
        return streamrl_config(workload, seed, staleness, run_dir)
    cfg = streamrl_config("W2", seed, staleness, run_dir)
    cfg["model"] = {"tiny": {**W3["model"]["tiny"], "seed": seed}}
    cfg["task"] = {**W3["task"], "seed": seed}
    cfg["algo"] = {**W3["algo"], "max_staleness": staleness}
    cfg["output"]["name"] = f"W3-k{staleness}-s{seed}"
    return cfg


def phase_of(frames: list[str]) -> str:
    if frames and LOOP_POLL.search(frames[-1]):
        return "event loop poll"
    for frame in reversed(frames):  # innermost first
        for name, patterns in COMPILED:
            if any(p.search(frame) for p in patterns):
                return name
    return "other"


def role_of(pid_samples: collections.Counter[str], chain: list[str]) -> str:
    """A process's role from its stage modules' samples; ``chain``: its ancestry, itself last (a
    worker forked by the forkserver keeps the forkserver's command line, one level deeper)."""
    if len(chain) == 1:
        return "launcher"
    if "forkserver" in chain[-1] and (len(chain) == 2 or "forkserver" not in chain[-2]):
        return "forkserver"
    if pid_samples:
        return pid_samples.most_common(1)[0][0]
    return "?"


def parse(raw: Path, rate: int) -> dict[str, dict[str, float]]:
    """Busy seconds per (process role, phase)."""
    per_pid: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    roles: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    chains: dict[str, list[str]] = {}
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        parts = stack.split(";")
        procs = [p for p in parts if p.startswith("process ")]
        head = procs[-1]
        pid = head.split(":", 1)[0].split()[1]
        chains[pid] = procs
        frames = [p for p in parts if not p.startswith("process ")]
        per_pid[pid][phase_of(frames)] += n
        for f in frames:
            m = ROLE_OF_MODULE.search(f)
            if m:
                roles[pid][m.group(1).rsplit("/", 1)[1]] += n
            elif "streamrl/dock/warehouse.py" in f:
                roles[pid]["warehouse"] += n
            elif "streamrl/dock/controller.py" in f:
                roles[pid]["dock controller"] += n
    out: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    for pid, phases in per_pid.items():
        role = role_of(roles[pid], chains[pid])
        for phase, n in phases.items():
            out[role][phase] += n / rate
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=["W1", "W2", "W3"], default="W2")
    ap.add_argument("--staleness", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rate", type=int, default=100, help="samples per second per thread")
    ap.add_argument("--keep", type=Path, default=None, help="copy the raw py-spy file and run dir here")
    args = ap.parse_args()
    if shutil.which("py-spy") is None:
        raise SystemExit("py-spy is not installed: pip install py-spy")
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        cfg_path = tmp / "config.yaml"
        cfg_path.write_text(yaml.safe_dump(config(args.workload, args.seed, args.staleness, str(tmp / "runs"))))
        raw = tmp / "pyspy.txt"
        load0 = os.getloadavg()[0]
        proc = subprocess.run(["py-spy", "record", "--subprocesses", "--rate", str(args.rate), "--format", "raw",
                               "--nonblocking", "-o", str(raw), "--", sys.executable, "-m", "streamrl.cli", "run",
                               str(cfg_path), "--print-result"], capture_output=True, text=True, timeout=1800,
                              cwd=ROOT)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
        if proc.returncode != 0 or not lines:
            raise SystemExit(f"the run failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
        result = json.loads(lines[-1])
        run_dir = Path(result["run_dir"])
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        busy = parse(raw, args.rate)
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            shutil.copy(raw, args.keep / f"{args.workload}-k{args.staleness}.pyspy.txt")
            shutil.copytree(run_dir, args.keep / f"{args.workload}-k{args.staleness}-run", dirs_exist_ok=True)
    load1 = os.getloadavg()[0]
    steps = max(len(rows), 1)
    train_s, setup_s = result["train_s"], result["setup_s"]
    print(f"{args.workload} k={args.staleness} seed {args.seed}: {steps} steps, setup {setup_s:.1f} s, training "
          f"{train_s:.1f} s ({train_s / steps * 1e3:.0f} ms/step), load {load0:.2f} -> {load1:.2f}")
    print("\nbusy seconds per process over the whole run (start-up included), and per step by phase:")
    table = []
    summary: dict[str, dict[str, float]] = {}
    for role, phases in sorted(busy.items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(phases.values())
        top = sorted(phases.items(), key=lambda kv: -kv[1])
        summary[role] = {k: round(v / steps * 1e3, 2) for k, v in top}
        table.append([role, f"{total:.1f}", ", ".join(f"{k} {v / steps * 1e3:.0f} ms" for k, v in top[:6])])
    print_table(["process", "busy s", "per step (ms), largest phases first"], table)
    keys = ["step_time_s", "train_ms", "hand_over_ms", "wait_other_ranks_ms", "checkpoint_s"]
    later = rows[1:] or rows  # step 1 carries warm-up
    figures = {k: statistics.median(r[k] for r in later) for k in keys if all(k in r for r in later)}
    print("\ntrainer, median over steps 2..: " + ", ".join(f"{k} {v:.3g}" for k, v in figures.items()))
    print_json_line("profile_steps", {"workload": args.workload, "staleness": args.staleness, "steps": steps,
                                      "train_s": train_s, "setup_s": setup_s, "per_step_ms": summary,
                                      "trainer": figures, "load": [round(load0, 2), round(load1, 2)]},
                    baseline={}, ratio={}, target={"note": "a breakdown: no target"})


if __name__ == "__main__":
    main()
