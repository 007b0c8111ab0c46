"""Where a train micro-batch's and a generate call's CPU time goes, by kernel class, against the machine.

    python ops/bench/kernel_classes.py                   # W2's shapes, 2 threads
    python ops/bench/kernel_classes.py --shape w3 --threads 1
    python ops/bench/kernel_classes.py --matmul-precision medium   # model.matmul_precision medium
    python ops/bench/kernel_classes.py --dtype bfloat16             # model.dtype bfloat16

Measures, in one process:

- the machine: the fp32 matmul rate (a 1024^3 ``mm``) and the bandwidth of ``copy_`` (bytes read +
  written per second) between 8 MiB buffers (in the L3 cache, where a step's activations sit) and
  512 MiB ones (main memory), on the same threads;
- the train engine (``FSDPTrainEngine``, one rank): one micro-batch of 8 groups x 8 completions
  (``accumulate``: forward + backward), digit prompts and completions of the workload's lengths;
- the built-in rollout engine: one ``generate`` call of the workload's step (no EOS stop).

Each is timed without the profiler (median of ``--calls``), then profiled once (torch.profiler,
shapes recorded), and every operator's own time is put in a class:

- ``matmul``: mm / addmm (the linear layers, forward and backward); multiply-adds counted from
  the shapes, so the class has a rate in GFLOP/s, next to the machine's matmul rate;
- ``attention``: the SDPA kernels (flash attention's forward and backward on CPU) and the batched
  matmuls (bmm / baddbmm: the decode step's attention over the cache);
- ``other``: every other operator (elementwise, norms, softmax, copies, cat, gathers, sampling,
  the optimizer's foreach kernels). Its bytes are estimated from the recorded input shapes (each
  input read once, an output as large as the largest input written once, 4 bytes an element),
  so its rate is a lower bound of the bandwidth it used, next to the cached ``copy_`` rate: near
  it, the class is bound by moving its operands; well below it, by each kernel's fixed cost (the
  dispatch, the threads' fork and join), which only fewer kernels reduce.

Why: at a small width, how much of a step is not matmul decides how close a pipeline can come to
the machine's FLOP ceiling, and what bounds that part says what could shrink it.

Last line: one JSON object (figures: each class's ms, share and rate; baseline: the machine's
rates; ratio: each rate over the machine's).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any, get_args

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ops.bench._common import median_seconds, print_json_line, print_table  # noqa: E402
from streamrl.config import MatmulPrecision  # noqa: E402

# The workloads' models and steps (ops/bench/grpo_vs_trl.py's W2, profile_steps.py's W3).
SHAPES: dict[str, dict[str, Any]] = {
    "w2": {"hidden": 256, "layers": 4, "heads": 8, "intermediate": 512, "digits": (2, 24),
           "prompts": 16, "samples": 8, "new_tokens": 32},
    "w3": {"hidden": 384, "layers": 6, "heads": 6, "intermediate": 1024, "digits": (2, 12),
           "prompts": 32, "samples": 4, "new_tokens": 16},
}
MATMUL = {"aten::mm", "aten::addmm"}
BATCHED = {"aten::bmm", "aten::baddbmm"}
# operators that only make a tensor's metadata (a view, an alias) or an empty allocation: not kernels
VIEWS = {"aten::view", "aten::as_strided", "aten::slice", "aten::select", "aten::transpose", "aten::t",
         "aten::reshape", "aten::unsqueeze", "aten::squeeze", "aten::expand", "aten::permute", "aten::narrow",
         "aten::detach", "aten::alias", "aten::view_as", "aten::unflatten", "aten::flatten", "aten::split",
         "aten::chunk", "aten::unbind", "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::lift_fresh",
         "aten::resolve_conj", "aten::resolve_neg", "aten::result_type", "aten::_unsafe_view", "aten::to"}
TRAIN_GROUPS = 8  # one train micro-batch: 8 groups (64 completions with 8 samples a prompt)


def machine_rates(calls: int = 30, dtype: str = "float32") -> dict[str, float]:
    """matmul GFLOP/s in ``dtype`` (1024^3 mm) and float32 copy GB/s (read + write) in cache and from
    memory, on this process's threads."""
    import torch

    a, b = (torch.randn(1024, 1024, dtype=getattr(torch, dtype)) for _ in range(2))
    # 2 x 8 MiB: past each core's L2 (2 MiB here), inside the shared L3, where a step's activations
    # live; 2 x 512 MiB: past any L3, main memory
    cached_src, cached_dst = torch.randn(2 * 2**20), torch.empty(2 * 2**20)
    src, dst = torch.randn(128 * 2**20), torch.empty(128 * 2**20)

    def median_s(fn: Any) -> float:  # 10 warm-ups: the threads' first parallel regions, the pages' first touch
        return median_seconds(fn, calls, warmup=10)

    # the best of three medians: a neighbour's burst on a shared host lowers a rate, never raises it
    return {"matmul_gflops": 2 * 1024**3 / min(median_s(lambda: a @ b) for _ in range(3)) / 1e9,
            "cached_copy_gbps": 2 * cached_src.numel() * 4 / min(
                median_s(lambda: cached_dst.copy_(cached_src)) for _ in range(3)) / 1e9,
            "copy_gbps": 2 * src.numel() * 4 / median_s(lambda: dst.copy_(src)) / 1e9}


def _numel(shape: Any) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def matmul_flops(name: str, shapes: list[Any]) -> float:
    """Multiply-adds x 2 of one mm / addmm call, from its input shapes."""
    (m, k), (_, n) = (shapes[0], shapes[1]) if name == "aten::mm" else (shapes[1], shapes[2])
    return 2.0 * m * k * n


def other_bytes(shapes: list[Any]) -> float:
    """Estimated bytes of one non-matmul call: its inputs read, an output of the largest input's size written."""
    sizes = [_numel(s) for s in shapes if isinstance(s, list) and s and all(isinstance(x, int) for x in s)]
    return 4.0 * (sum(sizes) + max(sizes, default=0))


def classify(prof: Any) -> dict[str, dict[str, float]]:
    """Per class: own CPU ms, and from the recorded shapes FLOPs (matmul) or estimated bytes and kernel
    count (other). Bytes and kernels come from leaf operators only: a composite one (``rms_norm``,
    ``to``) runs its work in the operators it calls, which are counted themselves."""
    out = {c: {"ms": 0.0, "flops": 0.0, "bytes": 0.0, "calls": 0.0} for c in ("matmul", "attention", "other")}
    for event in prof.events():
        name = event.name
        if not name.startswith("aten::") or name in VIEWS:  # a view only makes metadata: no kernel runs
            continue
        ms = event.self_cpu_time_total / 1e3
        if name in MATMUL:
            out["matmul"]["ms"] += ms
            out["matmul"]["flops"] += matmul_flops(name, event.input_shapes)
        elif name in BATCHED or "scaled_dot_product" in name:
            out["attention"]["ms"] += ms
        else:
            out["other"]["ms"] += ms
            if not any(child.name.startswith("aten::") for child in event.cpu_children):
                out["other"]["bytes"] += other_bytes(event.input_shapes)
                out["other"]["calls"] += 1
    return out


def digits_prompt(tok: Any, rng: random.Random, digits: tuple[int, int]) -> Any:
    import torch

    text = "".join(str(rng.randint(0, 9)) for _ in range(rng.randint(*digits)))
    return torch.tensor(tok.encode(text + "="), dtype=torch.int64)


def measure(shape_name: str, calls: int, dtype: str = "float32") -> dict[str, Any]:
    """``dtype``: the compute dtype (model.dtype): the train engine's, and the rollout engine's model's."""
    import torch
    import torch.distributed as dist
    from torch.profiler import profile

    from streamrl.algos.grpo import LossConfig
    from streamrl.engines.fsdp import FSDPOptions, FSDPTrainEngine
    from streamrl.engines.rollout import TorchRolloutEngine
    from streamrl.engines.samples import TrainSample
    from streamrl.models.build import TinyModelSpec, build_model
    from streamrl.models.tokenizer import build_char_tokenizer
    from streamrl.runtime.host_memory import keep_freed_memory

    keep_freed_memory()  # the workers' malloc settings: a step's buffers reused, not faulted in again
    shape = SHAPES[shape_name]
    tok = build_char_tokenizer()
    spec = TinyModelSpec(hidden=shape["hidden"], layers=shape["layers"], heads=shape["heads"],
                         intermediate=shape["intermediate"], seed=0)
    rng = random.Random(0)
    results: dict[str, Any] = {}

    def timed(fn: Any) -> tuple[float, Any]:
        ms = median_seconds(fn, calls, warmup=3) * 1e3
        with profile(record_shapes=True) as prof:
            fn()
        return ms, prof

    # --- train: one micro-batch, forward + backward (gradients summed, stepped once at the end)
    with tempfile.TemporaryDirectory() as store_dir:
        dist.init_process_group("gloo", store=dist.FileStore(f"{store_dir}/store", 1), rank=0, world_size=1)
        try:
            engine = FSDPTrainEngine(build_model(spec, tok), lr=1e-3, max_grad_norm=1.0, device="cpu",
                                     options=FSDPOptions(dtype=dtype))  # type: ignore[arg-type]
            samples = []
            for _ in range(TRAIN_GROUPS):
                prompt = digits_prompt(tok, rng, shape["digits"])
                for _ in range(shape["samples"]):
                    response = torch.randint(3, 12, (rng.randint(shape["new_tokens"] // 3, shape["new_tokens"]),))
                    samples.append(TrainSample(prompt, response, rng.uniform(-1, 1),
                                               rollout_logprobs=torch.full((response.numel(),), -2.0)))
            loss = LossConfig()
            ms, prof = timed(lambda: engine.accumulate(samples, loss))
            engine.step()
            results["train"] = {"ms": ms, "classes": classify(prof)}
        finally:
            dist.destroy_process_group()

    # --- generate: one call of the workload's step
    rollout = TorchRolloutEngine(build_model(spec, tok).to(getattr(torch, dtype)), -1, tok.pad_token_id, "cpu")
    prompts = []
    for _ in range(shape["prompts"]):
        prompts += [digits_prompt(tok, rng, shape["digits"])] * shape["samples"]
    ms, prof = timed(lambda: rollout.generate(prompts, max_new_tokens=shape["new_tokens"], seed=0))
    results["generate"] = {"ms": ms, "classes": classify(prof)}
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="w2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=7, help="timed calls of each phase (median), after 3 warm-up calls")
    ap.add_argument("--matmul-precision", choices=get_args(MatmulPrecision), default="highest",
                    help="the phases' float32 matmul precision (model.matmul_precision); the machine's rates stay "
                         "float32's")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="the phases' compute dtype (model.dtype); the machine's matmul rate is measured in it "
                         "(the other class's bytes still count 4 an element: an upper bound where they are 2)")
    args = ap.parse_args()
    import torch

    from streamrl.models.matmul_precision import apply

    torch.set_num_threads(args.threads)
    machine = machine_rates(dtype=args.dtype)
    apply(args.matmul_precision)
    phases = measure(args.shape, args.calls, args.dtype)
    figures: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    rows = []
    for phase, result in phases.items():
        classes = result["classes"]
        profiled = sum(c["ms"] for c in classes.values())
        figures[f"{phase}_ms"] = result["ms"]
        for name, c in classes.items():
            share = c["ms"] / profiled if profiled else 0.0
            figures[f"{phase}_{name}_ms"] = c["ms"]
            figures[f"{phase}_{name}_share"] = share
            rate = ""
            if name == "matmul" and c["ms"] > 0:
                gflops = c["flops"] / (c["ms"] / 1e3) / 1e9
                figures[f"{phase}_matmul_gflops"] = gflops
                ratios[f"{phase}_matmul_over_machine"] = gflops / machine["matmul_gflops"]
                rate = f"{gflops:.0f} GFLOP/s ({gflops / machine['matmul_gflops']:.2f} of the machine's)"
            elif name == "other" and c["ms"] > 0:
                gbps = c["bytes"] / (c["ms"] / 1e3) / 1e9
                figures[f"{phase}_other_gbps_estimate"] = gbps
                ratios[f"{phase}_other_over_cached_copy"] = gbps / machine["cached_copy_gbps"]
                figures[f"{phase}_other_kernels"] = c["calls"]
                figures[f"{phase}_other_us_per_kernel"] = c["ms"] * 1e3 / max(c["calls"], 1)
                rate = (f">= {gbps:.0f} GB/s ({gbps / machine['cached_copy_gbps']:.2f} of a cached copy_'s); "
                        f"{c['calls']:.0f} kernels, "
                        f"{c['ms'] * 1e3 / max(c['calls'], 1):.1f} us each")
            rows.append([phase, name, f"{c['ms']:.1f}", f"{share:.2f}", rate])
        rows.append([phase, "(unprofiled call)", f"{result['ms']:.1f}", "", ""])
    print(f"shape {args.shape}, {args.threads} threads, {args.dtype}, matmul precision {args.matmul_precision}; "
          f"machine: {args.dtype} matmul {machine['matmul_gflops']:.0f} "
          f"GFLOP/s, copy_ {machine['cached_copy_gbps']:.0f} GB/s in L3 and {machine['copy_gbps']:.0f} GB/s from "
          f"memory; load average {os.getloadavg()[0]:.2f}")
    print_table(["phase", "class", "own ms (profiled)", "share", "rate"], rows)
    print_json_line("kernel_classes", figures, machine, ratios, {"note": "no target: a breakdown"},
                    shape=args.shape, threads=args.threads,
                    matmul_precision=args.matmul_precision, dtype=args.dtype, load_average=list(os.getloadavg()))


if __name__ == "__main__":
    main()
