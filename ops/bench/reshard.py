"""Reshard benchmark: bucketed allgather-swap vs the naive reshard vs a plain all_gather, same run.

A train group of R=2 gloo processes (nccl with --device cuda) holds a >= 50M-parameter Qwen2
model sharded by the train engine's FSDP2 (``FSDPTrainEngine``; the resharder reads its
``to_local()`` shards, fp32; ``--shards synthetic``: the same layout cut from random tensors). For each inference TP degree T, three methods
run interleaved (rotating order, after one warm-up round), ``--repeats`` times:

* ``allgather_swap``: :class:`streamrl.reshard.Resharder` with ``--bucket-mib`` buckets; each
  rank fills its inference TP slice (fused qkv / gate_up, vocab-parallel embeddings).
* ``naive`` (baseline): the same code with one bucket: gather the full model on every rank,
  then slice.
* ``plain_all_gather`` (baseline for time): one ``torch.distributed`` all-gather of exactly the
  bytes the train group holds (a pre-packed flat shard) into a preallocated, warm output,
  nothing else: the best case for moving those bytes with torch's collective.
* ``plain_ring_all_gather`` (reference): the same bytes through the reshard's own in-place
  collective (:func:`streamrl.reshard.collectives.all_gather_in_place`; on gloo a point-to-point
  ring, because gloo's all-gather stages a second full-size copy), in one call, same warm
  output, no slicing: the reshard's time over this one is the cost of bucketing, packing and
  slicing.

The reshards allocate their buffers inside the timed call, as they do in use.

Per method: wall time (max over ranks: a reshard is done when the slowest rank is), peak extra
bytes from the reshard's accounting (for the baselines: their output buffer), and the peak
resident-memory growth sampled from /proc/self/statm during the call (CPU) or the allocator
peak (CUDA) as a measured cross-check (for the baselines: what the collective itself adds).
The inference slices of both reshards are compared bitwise.

Targets: peak extra <= one bucket; time <= 1.5x the plain all_gather.

    python ops/bench/reshard.py                 # ~1-2 min on 2 CPU cores
    python ops/bench/reshard.py --device cuda   # needs 2 GPUs (nccl)

The disaggregated placement (train ranks sending to generation workers) has its own benchmark,
``ops/bench/reshard_disaggregated.py``, which reuses this file's model, shards, sampler and
process start-up.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import Qwen2Config, Qwen2ForCausalLM

from streamrl.engines.fsdp import FSDPTrainEngine
from streamrl.reshard import (
    ModelShardingSpec,
    ReshardConfig,
    Resharder,
    Topology,
    TrainLayout,
    build_rank_groups,
    shard_tensor,
)
from streamrl.reshard.collectives import all_gather_flat, all_gather_in_place, synchronize
from streamrl.reshard.fsdp_layout import spec_for_placements
from streamrl.reshard.spec import ParamSpec

try:
    from ops.bench._common import fmt_spread, print_json_line, print_table, spread
except ImportError:  # run as a script from anywhere
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import fmt_spread, print_json_line, print_table, spread

METHODS = ("allgather_swap", "naive", "plain_all_gather", "plain_ring_all_gather")
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class RssPeak:
    """Peak resident-set growth of this process while the block runs (sampled every 0.5 ms)."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE

    def __enter__(self) -> RssPeak:
        self.base = self.rss()
        self.peak = 0
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss() - self.base)
            time.sleep(0.0005)

    def __exit__(self, *exc: object) -> None:
        self.peak = max(self.peak, self.rss() - self.base)
        self._stop.set()
        self._thread.join()


class MeasuredPeak:
    """Measured peak extra memory of a block on ``device``: the resident-set growth (:class:`RssPeak`)
    on CPU, the allocator's peak over what was allocated before (CUDA/NPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.accel = getattr(torch, device.type) if device.type != "cpu" else None
        self.rss = RssPeak()
        self.peak = 0

    def __enter__(self) -> MeasuredPeak:
        if self.accel is not None:
            self.accel.synchronize(self.device)
            self.base = self.accel.memory_allocated(self.device)
            self.accel.reset_peak_memory_stats(self.device)
        else:
            self.rss.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.accel is not None:
            self.peak = self.accel.max_memory_allocated(self.device) - self.base
        else:
            self.rss.__exit__(*exc)
            self.peak = self.rss.peak


def model_config(args: argparse.Namespace) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        tie_word_embeddings=False,
    )


def _run_method(
    method: str,
    resharders: dict[str, Resharder],
    shards: dict[str, torch.Tensor],
    flat: torch.Tensor,
    plain_out: torch.Tensor,
    out: dict[str, dict[str, torch.Tensor]],
    group: Any,
    device: torch.device,
) -> tuple[float, int, int]:
    """(seconds, accounted peak extra bytes, measured peak extra bytes) of one call on this rank."""
    dist.barrier(group=group)
    with MeasuredPeak(device) as measured:
        t0 = time.perf_counter()
        if method in ("plain_all_gather", "plain_ring_all_gather"):
            # best case for the baselines: the output buffer is preallocated and warm (not timed,
            # not in the measured growth); its size is their accounted peak
            rank = dist.get_rank(group)
            if method == "plain_all_gather":
                all_gather_flat(plain_out, flat, group=group)
            else:
                plain_out[rank * flat.numel() : (rank + 1) * flat.numel()].copy_(flat)
                all_gather_in_place(plain_out, group)
            synchronize(device)
            accounted = plain_out.numel() * plain_out.element_size()
        else:
            report = resharders[method].reshard_local(shards, out[method], version=1)
            accounted = report.peak_extra_bytes
        seconds = time.perf_counter() - t0
    return seconds, accounted, measured.peak


def interleaved(methods: tuple[str, ...], repeats: int) -> Iterator[tuple[int, tuple[str, ...]]]:
    """(rep, order) for a warm-up round (rep 0) and ``repeats`` measured ones, the order rotating."""
    for rep in range(repeats + 1):
        yield rep, methods[rep % len(methods) :] + methods[: rep % len(methods)]


def train_shards(
    spec: ModelShardingSpec, layout: TrainLayout, rank: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """Train rank ``rank``'s dim-0 shards of the benchmark model (:func:`full_tensors`)."""
    return {p.name: shard_tensor(full, p, layout, rank).to(device) for p, full in full_tensors(spec)}


def fsdp_shards(config: Qwen2Config, device: torch.device) -> tuple[ModelShardingSpec, dict[str, torch.Tensor]]:
    """The train engine's own shards: the benchmark model sharded by FSDP2 over the whole world
    (``to_local()`` of every parameter, unpadded), and the spec as its placements hold it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
    engine = FSDPTrainEngine(model, lr=1e-3, device=device)
    spec, _ = spec_for_placements(ModelShardingSpec.from_config(config), engine.model)
    return spec, engine.local_shards()


def full_tensors(spec: ModelShardingSpec) -> Iterator[tuple[ParamSpec, torch.Tensor]]:
    """The full parameters of a seeded random model (the same on every run), one at a time in
    spec order: a caller that drops each before the next never holds the whole model."""
    generator = torch.Generator().manual_seed(0)
    for p in spec.params:
        yield p, torch.randn(p.shape, generator=generator) * 0.02


RankFn = Callable[[int, int, argparse.Namespace, torch.device], Any]


def _rank_entry(rank: int, fn: RankFn, world: int, args: argparse.Namespace, workdir: str) -> None:
    torch.set_num_threads(args.threads)
    device = torch.device(f"cuda:{rank}" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"file://{workdir}/store",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=300),
    )
    try:
        result = fn(rank, world, args, device)
        if result is not None:
            Path(workdir, f"result-{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def spawn_world(fn: RankFn, world: int, args: argparse.Namespace) -> list[Any]:
    """Run ``fn(rank, world, args, device)`` in ``world`` spawned processes (one torch.distributed
    world, rendezvous through a FileStore in a temporary directory, ``args.threads`` torch threads
    each); every rank's JSON-able return value (None where it returned None), by rank. All the
    processes have exited when this returns (``start_processes`` joins them, and terminates the
    others when one fails)."""
    with tempfile.TemporaryDirectory(prefix="streamrl-bench-reshard-") as workdir:
        mp.start_processes(_rank_entry, args=(fn, world, args, workdir), nprocs=world, start_method="spawn")
        files = [Path(workdir, f"result-{rank}.json") for rank in range(world)]
        return [json.loads(f.read_text()) if f.exists() else None for f in files]


def rank_main(rank: int, world: int, args: argparse.Namespace, device: torch.device) -> dict[str, Any] | None:
    config = model_config(args)
    layout = TrainLayout(world)
    if args.shards == "fsdp":
        spec, shards = fsdp_shards(config, device)
    else:
        spec = ModelShardingSpec.from_config(config)
        shards = train_shards(spec, layout, rank, device)
    flat = torch.cat([s.reshape(-1) for s in shards.values()])  # the plain all_gather's input
    plain_out = torch.ones(flat.numel() * world, device=device)  # touched: resident before timing
    result: dict[str, Any] = {"params": spec.numel(), "shard_bytes": flat.numel() * 4, "by_t": {}}
    for T in args.inference_tp:
        groups = build_rank_groups(Topology.colocated(layout, T))
        resharders = {
            "allgather_swap": Resharder(
                spec, groups, config=ReshardConfig(bucket_bytes=args.bucket_mib * 2**20), device=device
            ),
            "naive": Resharder(spec, groups, config=ReshardConfig(bucket_bytes=None), device=device),
        }
        out = {
            m: {n: torch.zeros(s, device=device) for n, s in r.inference_shapes().items()}
            for m, r in resharders.items()
        }
        samples: dict[str, dict[str, list[float]]] = {m: {"s": [], "acc": [], "meas": []} for m in METHODS}
        for rep, order in interleaved(METHODS, args.repeats):  # rep 0 warms up (pages, gloo buffers)
            for method in order:
                seconds, accounted, measured = _run_method(
                    method, resharders, shards, flat, plain_out, out, groups.reshard_group, device
                )
                slowest = torch.tensor([seconds], dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # default group, gloo/nccl alike
                if rep > 0:
                    samples[method]["s"].append(float(slowest))
                    samples[method]["acc"].append(accounted)
                    samples[method]["meas"].append(measured)
        equal = all(torch.equal(out["naive"][n], out["allgather_swap"][n]) for n in out["naive"])
        bucketed = resharders["allgather_swap"]
        result["by_t"][str(T)] = {
            "samples": samples,
            "slices_equal": equal,
            "buckets": len(bucketed.buckets),
            "largest_bucket_bytes": bucketed.largest_bucket_bytes(),
            "inference_bytes": sum(t.numel() * 4 for t in out["naive"].values()),
        }
    return result if rank == 0 else None


def bench_parser(doc: str | None) -> argparse.ArgumentParser:
    """The options every reshard benchmark shares: device, R, bucket cap, repeats, threads, model."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--world", type=int, default=2, help="train ranks R")
    parser.add_argument("--bucket-mib", type=int, default=32, help="bucket cap in MiB (gathered bytes)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    return parser


def check_devices(args: argparse.Namespace, processes: int) -> None:
    if args.device == "cuda" and torch.cuda.device_count() < processes:
        raise SystemExit(f"--device cuda needs {processes} GPUs, found {torch.cuda.device_count()}")


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--inference-tp", type=int, nargs="+", default=[2, 1], help="inference T values")
    parser.add_argument("--shards", choices=["fsdp", "synthetic"], default="fsdp",
                        help="fsdp: the train engine's FSDP2 shards (to_local()); synthetic: padded shards of "
                             "random full tensors cut by streamrl.reshard.shards")
    args = parser.parse_args()
    check_devices(args, args.world)

    started = time.perf_counter()
    result = spawn_world(rank_main, args.world, args)[0]

    R, mib = args.world, 2**20
    print(
        f"reshard benchmark: {result['params'] / 1e6:.1f}M params fp32, R={R} ({args.device}), "
        f"bucket cap {args.bucket_mib} MiB, {args.repeats} repeats; times in ms [min, max], bytes in MiB"
    )
    rows, per_t = [], {}
    for T, data in result["by_t"].items():
        figures = {}
        for method in METHODS:
            s = data["samples"][method]
            figures[method] = {
                "time_ms": spread(x * 1e3 for x in s["s"]),
                "peak_extra_mib_accounted": max(s["acc"]) / mib,
                "peak_extra_mib_measured": spread(x / mib for x in s["meas"]),
            }
            rows.append(
                [
                    f"T={T}",
                    method,
                    fmt_spread(figures[method]["time_ms"]),
                    f"{max(s['acc']) / mib:.1f}",
                    fmt_spread(figures[method]["peak_extra_mib_measured"]),
                ]
            )
        swap, naive, plain, ring = (figures[m] for m in METHODS)
        per_t[T] = {
            "figures": figures,
            "buckets": data["buckets"],
            "largest_bucket_mib": data["largest_bucket_bytes"] / mib,
            "slices_equal": data["slices_equal"],
            "ratio": {
                "peak_extra_vs_naive": swap["peak_extra_mib_accounted"] / naive["peak_extra_mib_accounted"],
                "peak_extra_vs_largest_bucket": swap["peak_extra_mib_accounted"]
                / (data["largest_bucket_bytes"] / mib),
                "time_vs_plain_all_gather": swap["time_ms"]["median"] / plain["time_ms"]["median"],
                "time_vs_naive": swap["time_ms"]["median"] / naive["time_ms"]["median"],
                "time_vs_plain_ring_all_gather": swap["time_ms"]["median"] / ring["time_ms"]["median"],
            },
        }
    print_table(["layout", "method", "time ms", "peak extra (accounted)", "peak extra (measured)"], rows)
    for T, d in per_t.items():
        r = d["ratio"]
        print(
            f"T={T}: {d['buckets']} buckets (largest {d['largest_bucket_mib']:.1f} MiB); peak extra vs naive "
            f"{r['peak_extra_vs_naive']:.3f}, vs one bucket {r['peak_extra_vs_largest_bucket']:.2f}; time vs "
            f"plain all_gather {r['time_vs_plain_all_gather']:.2f}x, vs the same bytes through the ring "
            f"{r['time_vs_plain_ring_all_gather']:.2f}x, vs naive {r['time_vs_naive']:.2f}x; "
            f"slices equal: {d['slices_equal']}"
        )
    print(f"wall {time.perf_counter() - started:.0f} s")

    head = per_t[str(args.inference_tp[0])]
    target = {"peak_extra_vs_largest_bucket_max": 1.0, "time_vs_plain_all_gather_max": 1.5}
    met = {
        "peak": all(d["ratio"]["peak_extra_vs_largest_bucket"] <= 1.0 for d in per_t.values()),
        "time": head["ratio"]["time_vs_plain_all_gather"] <= 1.5,
        "slices_equal": all(d["slices_equal"] for d in per_t.values()),
    }
    print_json_line(
        "reshard",
        {"allgather_swap": head["figures"]["allgather_swap"], "inference_tp": args.inference_tp[0]},
        {m: head["figures"][m] for m in METHODS[1:]},
        head["ratio"],
        target,
        met=met,
        device=args.device,
        params=result["params"],
        train_ranks=R,
        bucket_mib=args.bucket_mib,
        by_inference_tp={T: {"ratio": d["ratio"], "buckets": d["buckets"]} for T, d in per_t.items()},
    )


if __name__ == "__main__":
    main()
