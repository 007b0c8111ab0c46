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

``--grain`` measures instead what sets the share's ``LAYER_GRAIN``: one Qwen2 decoder layer, as
training runs it (one packed row, forward and backward) and as decoding does (one token per
row, forward), at widths 128/256/512 and 16 to 2048 rows, on 2 torch threads against 1 (the
baseline), in a process with the workers' OpenMP waits.

    python ops/bench/core_share.py                  # W1 and W2, k = 0 and 1, 3 repetitions
    python ops/bench/core_share.py --workload W2 --reps 5
    python ops/bench/core_share.py --grain          # about a minute
    python ops/bench/core_share.py --against /tmp/old   # the defaults against another checkout's
                                                        # (git worktree add /tmp/old COMMIT)
    python ops/bench/core_share.py --event-loop --reps 5   # a compute thread's kernels, the worker's
                                                        # event loop thread pinned to 1 torch thread or not
    python ops/bench/core_share.py --optimizer --reps 3    # the train engine's optimizer step on 1 and 2
                                                        # threads, alone and beside a busy core

``--optimizer`` measures what sets ``ELEMENTWISE_GRAIN``: the FSDP2 train engine's ``step``
(gradient scaling and norm, AdamW; a world of one) at W1's, W2's and a 25M model's size, on 2
torch threads (the baseline: the stage's threads, what the share gave it before) and on 1, in a
process with the workers' OpenMP waits, once with the host otherwise quiet and once beside a
process that keeps the other core busy (as another stage's compute or the run's Python does).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import checkout_env, fmt_spread, median_seconds, print_json_line, print_table, ratio, spread
from grpo_vs_trl import ROOT, streamrl_config

# name -> (`streamrl run` overrides, environment the run starts with)
SETTINGS: dict[str, tuple[list[str], dict[str, str]]] = {
    "fixed": (["resources.core_share=false", "stages.generate.threads=1", "stages.generate.micro_batch=64"],
              {"OMP_WAIT_POLICY": "PASSIVE"}),
    "shared-64": (["stages.generate.micro_batch=64"], {}),
    "shared": ([], {}),
}
TARGET = 1.0  # the share must not be slower than fixed threads on any of these runs


def run(workload: str, staleness: int, setting: str, seed: int, tmp: Path,
        settings: dict[str, tuple[list[str], dict[str, str]]]) -> dict[str, float]:
    overrides, env_extra = settings[setting]
    path = tmp / f"{workload}-k{staleness}-{setting}.yaml"
    path.write_text(yaml.safe_dump(streamrl_config(workload, seed, staleness, str(tmp / "runs"))))
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    # --against: the other checkout's package first on the path (the pipeline files are this one's)
    cwd = Path(env_extra.get("PYTHONPATH", ROOT))
    proc = subprocess.run([sys.executable, "-m", "streamrl.cli", "run", str(path), *overrides, "--print-result"],
                          capture_output=True, text=True, timeout=900, cwd=cwd, env={**env, **env_extra})
    if proc.returncode != 0:
        raise RuntimeError(f"{workload} k={staleness} {setting} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    steps = int(result["steps"])
    batch = 64 if workload == "W1" else 128
    return {"completions_per_s": steps * batch / result["train_s"], "ms_per_step": 1000 * result["train_s"] / steps,
            "steps": steps}


GRAIN_WIDTHS = (128, 256, 512)
GRAIN_ROWS = (16, 32, 64, 128, 256, 512, 1024, 2048)


def workers_env() -> dict[str, str]:
    """This environment with the workers' OpenMP waits (the short spin) instead of the user's: they
    must be set before torch starts, so the timings run in a child process with it."""
    from streamrl.runtime.forkserver import openmp_waits

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(openmp_waits(env))
    return env


def child_lines(args: list[str], what: str, env: dict[str, str], timeout_s: float) -> list[str]:
    """The output lines of this script run again with ``args`` (a child mode) in ``env``; its
    stderr's end in the error if it fails."""
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=timeout_s,
                          cwd=ROOT, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout.splitlines()


def alternating(reps: int, first: str, second: str) -> Iterator[tuple[int, str]]:
    """(repetition, case) for two cases, in turn first each repetition, so that drift hits both."""
    for rep in range(reps):
        yield from ((rep, case) for case in ((first, second) if rep % 2 == 0 else (second, first)))


def layer_times(width: int, rows: int) -> dict[str, float]:
    """Median milliseconds of one decoder layer's train pass and decode pass, on 1 and 2 threads."""

    import torch
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    heads = max(4, width // 32)
    config = Qwen2Config(hidden_size=width, intermediate_size=2 * width, num_attention_heads=heads,
                         num_key_value_heads=heads, attn_implementation="sdpa")
    torch.manual_seed(0)
    layer, rope = Qwen2DecoderLayer(config, 0), Qwen2RotaryEmbedding(config)
    x = torch.randn(1, rows, width, requires_grad=True)  # training: one packed row of `rows` tokens
    positions = torch.arange(rows)[None]
    embeddings = rope(x, positions)
    xd = torch.randn(rows, 1, width)  # decoding: `rows` sequences, one token each
    positions_d = torch.zeros(rows, 1, dtype=torch.long)
    embeddings_d = rope(xd, positions_d)

    def train() -> None:
        out = layer(x, position_embeddings=embeddings, attention_mask=None, position_ids=positions)
        (out[0] if isinstance(out, tuple) else out).sum().backward()

    def decode() -> None:
        with torch.no_grad():
            layer(xd, position_embeddings=embeddings_d, attention_mask=None, position_ids=positions_d)

    times: dict[str, float] = {}
    for name, fn in (("train", train), ("decode", decode)):
        for threads in (1, 2):
            torch.set_num_threads(threads)
            times[f"{name}_{threads}"] = 1e3 * median_seconds(fn, 15 if rows < 1024 else 7, warmup=2)
    return times


def grain_child() -> None:
    for width in GRAIN_WIDTHS:
        for rows in GRAIN_ROWS:
            print(json.dumps({"width": width, "rows": rows, **layer_times(width, rows)}), flush=True)


def grain() -> None:
    from streamrl.engines.core_share import DECODE_GRAIN, LAYER_GRAIN

    load = [os.getloadavg()[0]]
    lines = child_lines(["--grain-child"], "the layer timings", workers_env(), 900)
    load.append(os.getloadavg()[0])
    rows_out, figures, baseline, ratios = [], {}, {}, {}
    below, above = [], []  # second-thread speed-ups on work under 2 grains (one thread) and from 2 grains
    for line in lines:
        r = json.loads(line)
        work = r["rows"] * r["width"] ** 2
        for name in ("train", "decode"):
            gain = r[f"{name}_1"] / r[f"{name}_2"]
            key = f"w{r['width']}_r{r['rows']}_{name}"
            figures[key + "_2threads_ms"] = round(r[f"{name}_2"], 3)
            baseline[key + "_1thread_ms"] = round(r[f"{name}_1"], 3)
            ratios[key] = round(gain, 3)
            grain = LAYER_GRAIN if name == "train" else DECODE_GRAIN  # (a layer alone undercounts decoding)
            (below if work < 2 * grain else above).append(gain)
            rows_out.append([r["width"], r["rows"], f"{work / 2**20:.2f}", name, f"{r[f'{name}_1']:.3f}",
                             f"{r[f'{name}_2']:.3f}", f"{gain:.2f}", max(1, min(2, work // grain))])
    print_table(["width", "rows", "work (M)", "pass", "1 thread ms", "2 threads ms", "speed-up",
                 "threads the share gives"], rows_out)
    print(f"speed-up of a second thread: under 2 grains {fmt_spread(spread(below), 2)}, "
          f"from 2 grains {fmt_spread(spread(above), 2)}; load average {min(load):.2f} .. {max(load):.2f}")
    print_json_line("core_share_grain", figures, baseline, ratios,
                    {"layer_grain": LAYER_GRAIN, "decode_grain": DECODE_GRAIN, "speed_up_under_2_grains_median_max": 1.25},
                    load_average=[min(load), max(load)],
                    speed_up_under_2_grains=spread(below), speed_up_from_2_grains=spread(above))


def event_loop_child(pinned: bool) -> None:
    """One worker process's threads: the main (event loop) thread runs a large op of its own (a
    message copy), then a compute thread times W2's optimizer step and a train micro-batch on 2
    torch threads. ``pinned``: the main thread first took ``pin_event_loop_thread``, as workers do."""
    import threading

    import torch

    from streamrl.runtime.worker import pin_event_loop_thread

    if pinned:
        pin_event_loop_thread(2)
    else:
        torch.set_num_threads(2)  # what a worker's main thread took before the pin
    torch.randn(1 << 22).mul_(2.0)  # the event loop's own work
    times: dict[str, float] = {}

    def compute() -> None:
        torch.set_num_threads(2)  # what the core share gives a stage computing alone
        params = [torch.randn(256, 512) for _ in range(16)]  # W2-sized, as its AdamW sees them
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
        a, b = torch.randn(2048, 256), torch.randn(256, 512)  # a W2 micro-batch's MLP matmul
        x = torch.randn(1 << 20)
        for name, fn, n in (("adamw_ms", opt.step, 50), ("matmul_ms", lambda: a @ b, 50),
                            ("elementwise_ms", lambda: x.mul_(1.0001), 200)):
            times[name] = 1e3 * median_seconds(fn, n, warmup=5)

    t = threading.Thread(target=compute)
    t.start()
    t.join()
    print(json.dumps(times), flush=True)


def event_loop(reps: int) -> None:
    """The compute thread's kernels with and without the event loop thread pinned to one torch thread."""
    env = workers_env()
    load = [os.getloadavg()[0]]
    got: dict[str, list[dict[str, float]]] = {"pinned": [], "unpinned": []}
    for rep, case in alternating(reps, "unpinned", "pinned"):
        got[case].append(json.loads(child_lines(["--event-loop-child", case], f"the {case} child", env, 300)[-1]))
        print(f"rep {rep} {case:9s} {got[case][-1]}", flush=True)
    load.append(os.getloadavg()[0])
    figures, baseline, ratios, rows = {}, {}, {}, []
    for name in ("adamw_ms", "matmul_ms", "elementwise_ms"):
        f = spread(r[name] for r in got["pinned"])
        b = spread(r[name] for r in got["unpinned"])
        figures[name], baseline[name] = f, b
        ratios[name] = round(ratio(b, f), 2)
        rows.append([name, fmt_spread(b, 3), fmt_spread(f, 3), f"{ratios[name]:.2f}"])
    print_table(["compute thread, 2 torch threads", "event loop with its own team", "event loop pinned to 1",
                 "speed-up"], rows)
    print(f"load average {min(load):.2f} .. {max(load):.2f}")
    print_json_line("core_share_event_loop", figures, baseline, ratios, {"speed_up": ">= 1"},
                    load_average=[min(load), max(load)])


OPTIMIZER_SIZES = {  # TinyModelSpec shapes: W1's, W2's (ops/bench/grpo_vs_trl.py) and cost_growth.py's 25M
    "W1": {"hidden": 128, "layers": 2, "heads": 4, "intermediate": 256},
    "W2": {"hidden": 256, "layers": 4, "heads": 8, "intermediate": 512},
    "25M": {"hidden": 512, "layers": 8, "heads": 8, "intermediate": 1024},
}
BUSY_MAX_S = 600.0  # the busy core's process ends by itself after this, whatever happens to the parent


def optimizer_child() -> None:
    """Median ms of the engine's step per size and thread count (one JSON line per size)."""
    import torch
    import torch.distributed as dist

    from streamrl.algos.grpo import LossConfig
    from streamrl.engines.fsdp import FSDPOptions, FSDPTrainEngine
    from streamrl.engines.samples import TrainSample
    from streamrl.models.build import build_model
    from streamrl.models.spec import TinyModelSpec
    from streamrl.models.tokenizer import build_char_tokenizer

    with tempfile.TemporaryDirectory(prefix="streamrl-optimizer-") as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
        try:
            tokenizer = build_char_tokenizer()
            gen = torch.Generator().manual_seed(0)
            batch = [TrainSample(torch.randint(3, 15, (8,), generator=gen), torch.randint(3, 15, (4,), generator=gen),
                                 advantage=1.0, rollout_logprobs=torch.full((4,), -2.0)) for _ in range(8)]
            for size, shape in OPTIMIZER_SIZES.items():
                torch.manual_seed(0)
                model = build_model(TinyModelSpec(**shape), tokenizer)
                params = sum(p.numel() for p in model.parameters())
                engine = FSDPTrainEngine(model, lr=1e-3, max_grad_norm=1.0, device="cpu", options=FSDPOptions())
                times: dict[str, float] = {}
                for threads in (2, 1):
                    torch.set_num_threads(threads)
                    took = []
                    for _ in range(14):
                        engine.accumulate(batch, LossConfig())  # gradients to step on (not timed)
                        t0 = time.perf_counter()
                        engine.step()
                        took.append(time.perf_counter() - t0)
                    times[f"{threads}_ms"] = 1e3 * sorted(took[2:])[len(took[2:]) // 2]
                print(json.dumps({"size": size, "params": params, **times}), flush=True)
        finally:
            dist.destroy_process_group()


def optimizer(reps: int) -> None:
    """The engine's step on 1 thread against 2, on a quiet host and beside a busy core."""
    env = workers_env()
    load = [os.getloadavg()[0]]
    got: dict[str, list[dict[str, Any]]] = {"quiet": [], "busy": []}
    for rep, case in alternating(reps, "quiet", "busy"):
        busy = None
        if case == "busy":  # a pure-Python loop: one core taken, no OpenMP of its own
            busy = subprocess.Popen([sys.executable, "-c", "import time\nend = time.monotonic() + "
                                     f"{BUSY_MAX_S}\nwhile time.monotonic() < end: pass"])
        try:
            lines = child_lines(["--optimizer-child"], f"the {case} child", env, 600)
        finally:
            if busy is not None:
                busy.kill()
                busy.wait(10)
        got[case] += [json.loads(line) for line in lines]
        print(f"rep {rep} {case:5s} {' '.join(lines)}", flush=True)
    load.append(os.getloadavg()[0])
    figures, baseline, ratios, rows = {}, {}, {}, []
    for size in OPTIMIZER_SIZES:
        for case in ("quiet", "busy"):
            runs = [r for r in got[case] if r["size"] == size]
            one, two = spread(r["1_ms"] for r in runs), spread(r["2_ms"] for r in runs)
            key = f"{size}_{case}"
            figures[f"{key}_1thread_ms"], baseline[f"{key}_2threads_ms"] = one, two
            ratios[key] = round(ratio(two, one), 2)
            rows.append([size, f"{runs[0]['params'] / 1e6:.2f}", case, fmt_spread(two, 2), fmt_spread(one, 2),
                         f"{ratios[key]:.2f}"])
    print_table(["model", "params (M)", "other core", "2 threads ms", "1 thread ms", "1 thread's speed-up"], rows)
    print(f"load average {min(load):.2f} .. {max(load):.2f}")
    print_json_line("core_share_optimizer", figures, baseline, ratios,
                    {"note": "a team only where a second thread gains on a quiet host; one thread faster beside a busy core"},
                    load_average=[min(load), max(load)], reps=reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=["W1", "W2", "both"], default="both")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--grain", action="store_true", help="time decoder layers on 1 and 2 threads instead")
    ap.add_argument("--grain-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--event-loop", action="store_true",
                    help="time a compute thread's kernels with the event loop thread pinned to one torch thread or not")
    ap.add_argument("--event-loop-child", choices=["pinned", "unpinned"], help=argparse.SUPPRESS)
    ap.add_argument("--optimizer", action="store_true",
                    help="time the train engine's optimizer step on 1 and 2 threads, quiet and beside a busy core")
    ap.add_argument("--optimizer-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--against", type=Path, metavar="CHECKOUT",
                    help="compare the defaults with another checkout's (e.g. a git worktree of an older commit) "
                         "instead of with the fixed threads")
    args = ap.parse_args()
    if args.grain_child:
        grain_child()
        return
    if args.grain:
        grain()
        return
    if args.event_loop_child:
        event_loop_child(args.event_loop_child == "pinned")
        return
    if args.event_loop:
        event_loop(args.reps)
        return
    if args.optimizer_child:
        optimizer_child()
        return
    if args.optimizer:
        optimizer(args.reps)
        return
    settings, base_name = SETTINGS, "fixed"
    if args.against is not None:
        settings, base_name = {"against": ([], checkout_env(args.against)), "shared": ([], {})}, "against"
    workloads = ["W1", "W2"] if args.workload == "both" else [args.workload]
    cases = [(w, k) for w in workloads for k in (0, 1)]
    results: dict[str, list[dict[str, float]]] = {}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="streamrl-core-share-") as tmp:
        for rep in range(args.reps):
            for w, k in cases:
                for setting in settings:
                    r = run(w, k, setting, args.seed, Path(tmp), settings)
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
        base = spread(r[metric] for r in results[f"{w} k={k} {base_name}"])
        baseline[f"{w}_k{k}_{metric}"] = base
        for setting in (name for name in settings if name != base_name):
            s = spread(r[metric] for r in results[f"{w} k={k} {setting}"])
            gain = ratio(s, base) if w == "W2" else ratio(base, s)
            figures[f"{w}_k{k}_{setting}_{metric}"] = s
            ratios[f"{w}_k{k}_{setting}"] = round(gain, 3)
            rows.append([f"{w} k={k}", metric, setting, fmt_spread(s), fmt_spread(base), f"{gain:.2f}"])
    print()
    print_table(["run", "figure", "setting", "median [min, max]", base_name, "speed-up"], rows)
    print(f"load average {min(load):.2f} .. {max(load):.2f}")
    print_json_line("core_share", figures, baseline, ratios, {"speed_up_min": TARGET},
                    load_average=[min(load), max(load)], reps=args.reps, baseline_setting=base_name,
                    against=str(args.against) if args.against else None)


if __name__ == "__main__":
    main()
