#!/usr/bin/env python3
"""The train engine at one rank: the module trained unwrapped (the default) against FSDP2-wrapped
(``FSDPOptions(wrap_single_rank=True)``), W1's and W2's micro-batch, in one process.

    python ops/bench/one_rank_trainer.py                    # both shapes, 1 torch thread
    python ops/bench/one_rank_trainer.py --shape w2 --threads 2

Each repetition times, alternating the two engines (same seeded model, same samples), one
``accumulate`` of a micro-batch of 8 prompt groups (forward and backward) and one ``step`` (the
gradient's normalisation, clipping and AdamW). At one rank FSDP2 has nothing to shard: its
per-layer gathers before the forward and the backward and its reduce-scatter of every gradient
only copy, so what the wrapped engine takes beyond the unwrapped one is that copying and its
dispatch. The two update the weights bit for bit alike (tests/engines/test_fsdp_single.py).

Last line: one JSON object (figures: the unwrapped engine's ms; baseline: the wrapped one's;
ratio: unwrapped / wrapped time, target <= 1).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ops.bench._common import fmt_spread, print_json_line, print_table, ratio, spread  # noqa: E402

# The workloads' models and micro-batches (ops/bench/grpo_vs_trl.py's W1 and W2)
SHAPES: dict[str, dict[str, Any]] = {
    "w1": {"hidden": 128, "layers": 2, "heads": 4, "intermediate": 256, "digits": (3, 3), "samples": 8,
           "new_tokens": 4},
    "w2": {"hidden": 256, "layers": 4, "heads": 8, "intermediate": 512, "digits": (2, 24), "samples": 8,
           "new_tokens": 32},
}
GROUPS = 8  # prompt groups per micro-batch


def measure(shape_name: str, reps: int, warmup: int) -> dict[str, dict[str, dict[str, float]]]:
    import torch
    import torch.distributed as dist

    from streamrl.algos.grpo import LossConfig
    from streamrl.engines.fsdp import FSDPOptions, FSDPTrainEngine
    from streamrl.engines.samples import TrainSample
    from streamrl.models.build import TinyModelSpec, build_model
    from streamrl.models.tokenizer import build_char_tokenizer

    shape = SHAPES[shape_name]
    tok = build_char_tokenizer()
    spec = TinyModelSpec(hidden=shape["hidden"], layers=shape["layers"], heads=shape["heads"],
                         intermediate=shape["intermediate"], seed=0)
    rng = random.Random(0)
    samples = []
    for _ in range(GROUPS):
        text = "".join(str(rng.randint(0, 9)) for _ in range(rng.randint(*shape["digits"])))
        prompt = torch.tensor(tok.encode(text + "="), dtype=torch.int64)
        for _ in range(shape["samples"]):
            response = torch.randint(3, 12, (rng.randint(1, shape["new_tokens"]),))
            samples.append(TrainSample(prompt, response, rng.uniform(-1, 1),
                                       rollout_logprobs=torch.full((response.numel(),), -2.0)))
    loss = LossConfig()
    times: dict[str, dict[str, list[float]]] = {side: {"accumulate": [], "step": []} for side in ("unwrapped", "fsdp2")}
    with tempfile.TemporaryDirectory() as store_dir:
        dist.init_process_group("gloo", store=dist.FileStore(f"{store_dir}/store", 1), rank=0, world_size=1)
        try:
            engines = {side: FSDPTrainEngine(build_model(spec, tok), lr=1e-3, max_grad_norm=1.0, device="cpu",
                                             options=FSDPOptions(wrap_single_rank=side == "fsdp2"))
                       for side in times}
            for rep in range(warmup + reps):
                for side, engine in engines.items():
                    t0 = time.perf_counter()
                    engine.accumulate(samples, loss)
                    t1 = time.perf_counter()
                    engine.step()
                    t2 = time.perf_counter()
                    if rep >= warmup:
                        times[side]["accumulate"].append((t1 - t0) * 1e3)
                        times[side]["step"].append((t2 - t1) * 1e3)
        finally:
            dist.destroy_process_group()
    return {side: {phase: spread(v) for phase, v in phases.items()} for side, phases in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=[*sorted(SHAPES), "both"], default="both")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (W1's layers run on 1 in a run)")
    ap.add_argument("--reps", type=int, default=40, help="timed repetitions of each engine, alternating")
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    import os

    import torch

    torch.set_num_threads(args.threads)
    shapes = sorted(SHAPES) if args.shape == "both" else [args.shape]
    figures, baseline, ratios = {}, {}, {}
    rows = []
    for name in shapes:
        got = measure(name, args.reps, args.warmup)
        figures[name], baseline[name] = got["unwrapped"], got["fsdp2"]
        ratios[name] = {phase: ratio(got["unwrapped"][phase], got["fsdp2"][phase]) for phase in ("accumulate", "step")}
        for phase in ("accumulate", "step"):
            rows.append([name, phase, fmt_spread(got["unwrapped"][phase], 2), fmt_spread(got["fsdp2"][phase], 2),
                         f"{ratios[name][phase]:.2f}"])
    print(f"threads {args.threads}, {args.reps} repetitions alternating, load {os.getloadavg()[0]:.2f}")
    print_table(["shape", "phase", "unwrapped ms", "FSDP2-wrapped ms", "ratio"], rows)
    print_json_line("one_rank_trainer", figures, baseline, ratios, {"ratio": "<= 1"}, threads=args.threads,
                    reps=args.reps)


if __name__ == "__main__":
    main()
