"""The built-in rollout engine's generation time, this checkout against a baseline, side by side.

    python ops/bench/decode_step.py                      # against the Hugging Face forward (the fallback path)
    python ops/bench/decode_step.py --against /tmp/old   # against another checkout's engine (a git worktree)
    python ops/bench/decode_step.py --reps 5 --threads 2 --shapes w2,w1,long

Each measurement is a fresh process (so ``--against`` imports the other checkout's package), with
the workers' malloc settings, that builds the model, warms up with 3 calls and times ``calls``
generate calls of one shape; settings alternate within each repetition, so load drift hits both.
No EOS stop: every call decodes the same number of steps. Shapes:

- ``w2``: W2's model (hidden 256, 4 layers), 16 ragged digit prompts (3-25 tokens) x 8 samples, 32 new tokens;
- ``w1``: W1's model (hidden 128, 2 layers), 8 prompts of 4 tokens x 8 samples, 4 new tokens;
- ``long``: W2's model, 8 prompts of 150-250 tokens x 8 samples, 64 new tokens (a prompt-heavy cache).

Figures: ms per call and per decode step (call / new tokens), median [min, max] over the
repetitions' medians. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

SHAPES: dict[str, dict[str, Any]] = {
    "w2": {"hidden": 256, "layers": 4, "heads": 8, "intermediate": 512, "prompts": 16, "samples": 8,
           "prompt_tokens": (2, 24), "new_tokens": 32, "calls": 20},
    "w1": {"hidden": 128, "layers": 2, "heads": 4, "intermediate": 256, "prompts": 8, "samples": 8,
           "prompt_tokens": (3, 3), "new_tokens": 4, "calls": 100},
    "long": {"hidden": 256, "layers": 4, "heads": 8, "intermediate": 512, "prompts": 8, "samples": 8,
             "prompt_tokens": (149, 249), "new_tokens": 64, "calls": 8},
}


def child(shape_name: str, threads: int, hf: bool) -> None:
    """Time one shape in this process; print {"call_ms": median} as JSON."""
    import torch

    import streamrl
    from streamrl.engines.rollout import TorchRolloutEngine
    from streamrl.models.build import TinyModelSpec, build_model
    from streamrl.models.tokenizer import build_char_tokenizer

    shape = SHAPES[shape_name]
    torch.set_num_threads(threads)
    tok = build_char_tokenizer()
    spec = TinyModelSpec(hidden=shape["hidden"], layers=shape["layers"], heads=shape["heads"],
                         intermediate=shape["intermediate"], max_positions=512, seed=0)
    model = build_model(spec, tok)
    engine = TorchRolloutEngine(model, -1, tok.pad_token_id, "cpu", use_functional=False if hf else None)
    rng = random.Random(0)
    prompts = []
    low, high = shape["prompt_tokens"]
    for _ in range(shape["prompts"]):
        digits = "".join(str(rng.randint(0, 9)) for _ in range(rng.randint(low, high)))
        prompts += [torch.tensor(tok.encode(digits + "="), dtype=torch.int64)] * shape["samples"]
    for seed in range(3):
        engine.generate(prompts, max_new_tokens=shape["new_tokens"], seed=seed)
    times = []
    for seed in range(shape["calls"]):
        t0 = time.perf_counter()
        engine.generate(prompts, max_new_tokens=shape["new_tokens"], seed=seed)
        times.append(time.perf_counter() - t0)
    print(json.dumps({"call_ms": statistics.median(times) * 1e3, "package": str(Path(streamrl.__file__).parent)}))


def worker_malloc() -> dict[str, str]:
    """The workers' malloc settings (streamrl.runtime.host_memory.keep_freed_memory) as glibc's
    environment variables, so that a child of either checkout runs with them: one arena, blocks
    below 32 MiB from the heap, 1 GiB of free top kept. Imported here, in the parent only: a child
    imports the package of the checkout it measures."""
    from streamrl.runtime.host_memory import KEPT_FREE_BYTES, MAX_MMAP_THRESHOLD

    return {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": str(MAX_MMAP_THRESHOLD),
            "MALLOC_TRIM_THRESHOLD_": str(KEPT_FREE_BYTES)}


def measure(shape: str, threads: int, env: dict[str, str], hf: bool) -> float:
    cmd = [sys.executable, __file__, "--child", shape, "--threads", str(threads)] + (["--hf"] if hf else [])
    out = subprocess.run(cmd, env={**os.environ, **worker_malloc(), **env}, capture_output=True, text=True,
                         timeout=600, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{shape} failed:\n{out.stderr[-2000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    expected = Path(env["PYTHONPATH"]).resolve() / "streamrl"
    if Path(result["package"]).resolve() != expected:  # the comparison would be this checkout against itself
        raise SystemExit(f"the child imported {result['package']}, not {expected}")
    return float(result["call_ms"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default="w2,w1,long")
    ap.add_argument("--against", type=Path, metavar="CHECKOUT",
                    help="another checkout's root: its engine is the baseline (default: the HF forward here)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--hf", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.threads, args.hf)
        return
    # Only in the parent: a child takes streamrl from its PYTHONPATH (--against's checkout).
    sys.path.insert(0, str(ROOT))
    from ops.bench._common import checkout_env, fmt_spread, print_json_line, print_table, ratio, spread

    shapes = args.shapes.split(",")
    unknown = set(shapes) - set(SHAPES)
    if unknown:
        raise SystemExit(f"--shapes: unknown {sorted(unknown)}; choose from {sorted(SHAPES)}")
    here = {"PYTHONPATH": str(ROOT)}
    if args.against is not None:
        base_env, base_hf, base_name = checkout_env(args.against), False, "against"
    else:
        base_env, base_hf, base_name = here, True, "hf_forward"
    ms: dict[tuple[str, str], list[float]] = {}
    for rep in range(args.reps):
        for shape in shapes:
            for setting, env, hf in (("this", here, False), (base_name, base_env, base_hf)):
                ms.setdefault((shape, setting), []).append(measure(shape, args.threads, env, hf))
        print(f"repetition {rep + 1}/{args.reps} done (load average {os.getloadavg()[0]:.1f})", flush=True)
    figures, baseline, ratios, rows = {}, {}, {}, []
    for shape in shapes:
        steps = SHAPES[shape]["new_tokens"]
        mine, base = spread(ms[(shape, "this")]), spread(ms[(shape, base_name)])
        figures[f"{shape}_call_ms"] = mine
        figures[f"{shape}_decode_step_ms"] = spread(v / steps for v in ms[(shape, "this")])
        baseline[f"{shape}_call_ms"] = base
        ratios[f"{shape}_speed_up"] = ratio(base, mine)
        rows.append([shape, fmt_spread(mine, 2), fmt_spread(base, 2), f"{ratios[f'{shape}_speed_up']:.2f}"])
    print_table(["shape", "ms a call (this)", f"ms a call ({base_name})", "speed-up"], rows)
    print_json_line("decode_step", figures, baseline, ratios, {"speed_up_min": 1.0}, reps=args.reps,
                    threads=args.threads, baseline_setting=base_name,
                    against=str(args.against) if args.against else None, load_average=list(os.getloadavg()))


if __name__ == "__main__":
    main()
