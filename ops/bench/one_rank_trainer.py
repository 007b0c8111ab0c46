#!/usr/bin/env python3
"""The train engine at one rank: the module trained unwrapped (the default) against FSDP2-wrapped
(``FSDPOptions(wrap_single_rank=True)``), W1's and W2's micro-batch, in one process.

    python ops/bench/one_rank_trainer.py                    # W1's and W2's shapes, 1 torch thread
    python ops/bench/one_rank_trainer.py --shape w2 --threads 2
    python ops/bench/one_rank_trainer.py --device cuda --shape all --dtype bfloat16 --deterministic

Each repetition times, alternating the two engines (same seeded model, same samples; the one that
goes first alternates too, ABBA, so that what one engine leaves behind does not bill the other), one
``accumulate`` of a micro-batch of 8 prompt groups (forward and backward) and one ``step`` (the
gradient's normalisation, clipping and AdamW). ``--dtype``: the compute dtype (``model.dtype``: the
unwrapped engine casts the float32 weights per forward, FSDP2 as it gathers). On an accelerator
each phase is timed to a device synchronisation; ``--deterministic`` turns on torch's
deterministic algorithms (on CUDA with ``CUBLAS_WORKSPACE_CONFIG=:4096:8``), under which the two
engines' losses and parameters must come out equal: the run prints the largest difference. At one rank FSDP2 has nothing to shard: its
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
    # a model of the size issue 24's cost table ends at, W2's micro-batch (an accelerator's shape)
    "100m": {"hidden": 768, "layers": 12, "heads": 12, "intermediate": 3072, "digits": (2, 24), "samples": 8,
             "new_tokens": 32},
}
GROUPS = 8  # prompt groups per micro-batch


def measure(shape_name: str, reps: int, warmup: int, device: str = "cpu", dtype: str = "float32"
            ) -> tuple[dict[str, dict[str, dict[str, float]]], float, bool]:
    """Each engine's phase times; the largest difference of their parameters after the run, and
    whether their losses were equal at every repetition."""
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
    kind = torch.device(device).type
    sync = torch.accelerator.synchronize if kind != "cpu" else (lambda: None)
    backend = "gloo" if kind == "cpu" else f"{kind}:{dist.Backend.default_device_backend_map[kind]},cpu:gloo"
    losses_equal = True
    with tempfile.TemporaryDirectory() as store_dir:
        dist.init_process_group(backend, store=dist.FileStore(f"{store_dir}/store", 1), rank=0, world_size=1)
        try:
            engines = {side: FSDPTrainEngine(build_model(spec, tok), lr=1e-3, max_grad_norm=1.0, device=device,
                                             options=FSDPOptions(dtype=dtype,  # type: ignore[arg-type]
                                                                 wrap_single_rank=side == "fsdp2"))
                       for side in times}
            assert [e.wrapped for e in engines.values()] == [False, True]
            for rep in range(warmup + reps):
                losses = []
                for side in ("unwrapped", "fsdp2") if rep % 4 in (0, 3) else ("fsdp2", "unwrapped"):
                    engine = engines[side]
                    sync()
                    t0 = time.perf_counter()
                    engine.accumulate(samples, loss)
                    sync()
                    t1 = time.perf_counter()
                    losses.append(engine.step()["loss"])
                    sync()
                    t2 = time.perf_counter()
                    if rep >= warmup:
                        times[side]["accumulate"].append((t1 - t0) * 1e3)
                        times[side]["step"].append((t2 - t1) * 1e3)
                losses_equal &= losses[0] == losses[1]
            a, b = (e.full_state_dict() for e in engines.values())
            diff = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
        finally:
            dist.destroy_process_group()
    return ({side: {phase: spread(v) for phase, v in phases.items()} for side, phases in times.items()},
            diff, losses_equal)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=[*sorted(SHAPES), "both", "all"], default="both",
                    help="both: w1 and w2; all: w1, w2 and 100m")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, npu (an accelerator: one of its devices)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                    help="the compute dtype (model.dtype) over float32 weights")
    ap.add_argument("--deterministic", action="store_true",
                    help="torch's deterministic algorithms: the two engines must then update alike")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (W1's layers run on 1 in a run)")
    ap.add_argument("--reps", type=int, default=40, help="timed repetitions of each engine, alternating")
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    import os

    import torch

    torch.set_num_threads(args.threads)
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
    shapes = ["w1", "w2"] if args.shape == "both" else ["w1", "w2", "100m"] if args.shape == "all" else [args.shape]
    figures, baseline, ratios = {}, {}, {}
    rows, equal = [], {}
    for name in shapes:
        got, diff, losses_equal = measure(name, args.reps, args.warmup, args.device, args.dtype)
        equal[name] = {"max_param_diff": diff, "losses_equal": losses_equal}
        figures[name], baseline[name] = got["unwrapped"], got["fsdp2"]
        ratios[name] = {phase: ratio(got["unwrapped"][phase], got["fsdp2"][phase]) for phase in ("accumulate", "step")}
        for phase in ("accumulate", "step"):
            rows.append([name, phase, fmt_spread(got["unwrapped"][phase], 2), fmt_spread(got["fsdp2"][phase], 2),
                         f"{ratios[name][phase]:.2f}"])
    print(f"{args.device}, {args.dtype}, threads {args.threads}, {args.reps} repetitions alternating, "
          f"load {os.getloadavg()[0]:.2f}")
    print_table(["shape", "phase", "unwrapped ms", "FSDP2-wrapped ms", "ratio"], rows)
    for name, got in equal.items():
        print(f"{name}: parameters after the run differ by {got['max_param_diff']:.3g} at most; "
              f"losses equal at every repetition: {got['losses_equal']}")
    print_json_line("one_rank_trainer", figures, baseline, ratios, {"ratio": "<= 1"}, threads=args.threads,
                    reps=args.reps, device=args.device, dtype=args.dtype, deterministic=args.deterministic,
                    equality=equal)


if __name__ == "__main__":
    main()
