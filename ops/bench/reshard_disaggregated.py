"""Disaggregated reshard benchmark: chunked sends vs the naive send vs a plain point-to-point send.

The colocated benchmark's model (``ops/bench/reshard.py``: >= 50M-parameter Qwen2, fp32, same
options) on R = 2 gloo train ranks, feeding generation workers in their own processes:
``Topology.disaggregated(TrainLayout(R), T, replicas)`` for each ``--setups`` entry ``TxREPLICAS``
(default ``1x2``: two workers, each a whole copy; ``2x1``: one replica split over two TP ranks).
Both default setups make a world of 4 processes (1 torch thread each), spawned once; every
process walks the setups and, in each, the methods interleaved (rotating order, after one
warm-up round), ``--repeats`` times:

* ``chunked``: the library path (``Resharder.send`` on the train ranks, ``receive_header`` +
  ``Resharder.receive`` on the workers) with ``ReshardConfig(bucket_bytes=--bucket-mib)``: the
  train group all-gathers bucket by bucket and streams each worker its slice through one
  staging chunk per side (default chunk min(bucket / 8, 4 MiB)).
* ``chunked_staging_<N>mib`` (trade-off, ``--staging-mib N``, 0 = off): the same with
  ``staging_bytes = N MiB``: fewer, larger messages, a larger staging chunk on both sides.
* ``naive`` (baseline): ``ReshardConfig(bucket_bytes=None)``: gather the whole model, stage a
  worker's whole slice once, send it as one message.
* ``plain_send`` (baseline for time): per destination one ``dist.send`` of a preallocated, warm
  flat buffer of exactly the bytes the reshard sends it (``recv`` into a preallocated buffer):
  the cost of moving those bytes with no gather, packing or slicing.

Per method: time per version (from a world barrier until the slowest of the 4 processes is
done: the version has arrived everywhere), the sender's and the receiver's accounted peak extra
bytes (``ReshardReport.peak_extra_bytes``; for ``plain_send`` its preallocated buffer), their
measured resident-memory growth during the call (the colocated benchmark's sampler), bytes per
destination and messages per destination. The workers' slices of every reshard method are
compared bitwise with each other and with slices cut from the full model.

Targets: sender peak <= 1 bucket + 1 chunk; receiver peak <= 1 chunk; time <= 1.5x the plain
send of the same bytes.

    python ops/bench/reshard_disaggregated.py        # ~1 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from streamrl.reshard import (
    ModelShardingSpec,
    RankGroups,
    ReshardConfig,
    Resharder,
    Topology,
    TrainLayout,
    build_rank_groups,
)
from streamrl.reshard.collectives import synchronize
from streamrl.reshard.shards import rect_in

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script from anywhere
from _common import fmt_spread, print_json_line, print_table, spread
from reshard import (
    MeasuredPeak,
    bench_parser,
    check_devices,
    full_tensors,
    interleaved,
    model_config,
    spawn_world,
    train_shards,
)

MIB = 2**20
ITEMSIZE = 4  # fp32 shards and inference weights
PLAIN = "plain_send"
BASELINES = ("naive", PLAIN)
SAMPLE_KEYS = ("s", "acc", "meas", "bytes", "split")  # per call, see _one_call


def parse_setup(text: str) -> tuple[int, int]:
    """``"TxREPLICAS"`` -> (T, replicas)."""
    T, _, replicas = text.partition("x")
    return int(T), int(replicas or 1)


def method_configs(args: argparse.Namespace) -> dict[str, ReshardConfig]:
    bucket = args.bucket_mib * MIB
    configs = {"chunked": ReshardConfig(bucket_bytes=bucket)}
    if args.staging_mib:
        configs[f"chunked_staging_{args.staging_mib}mib"] = ReshardConfig(
            bucket_bytes=bucket, staging_bytes=args.staging_mib * MIB
        )
    configs["naive"] = ReshardConfig(bucket_bytes=None)
    return configs


def slice_numel(resharder: Resharder, t: int) -> int:
    """Elements the reshard sends inference rank ``t`` per version (its pieces, no padding)."""
    return sum(resharder.bucket_slice_numel(t, b.index) for b in resharder.buckets)


def messages(resharder: Resharder, t: int) -> int:
    """Point-to-point messages per version to inference rank ``t`` (weight chunks + the header)."""
    return 1 + sum(1 for b in resharder.buckets for _ in resharder.chunks(t, b.index))


def _one_call(
    method: str,
    groups: RankGroups,
    resharders: dict[str, Resharder],
    shards: dict[str, torch.Tensor] | None,
    out: dict[str, dict[str, torch.Tensor]],
    plain: torch.Tensor,
    destinations: list[tuple[int, int]],
    device: torch.device,
    version: int,
) -> tuple[float, int, int, int, list[float]]:
    """(seconds, accounted peak extra bytes, measured peak extra bytes, bytes sent or received,
    a train rank's reshard time split [gather, fill chunks, send] in seconds)."""
    split = [0.0, 0.0, 0.0]
    dist.barrier()  # the whole world starts together
    with MeasuredPeak(device) as measured:
        t0 = time.perf_counter()
        if method == PLAIN:  # the preallocated, warm buffer is its accounted peak (not timed)
            if groups.is_train:
                for dest, numel in destinations:
                    dist.send(plain[:numel], dst=dest, group=groups.weight_group)
                moved = sum(numel for _, numel in destinations) * ITEMSIZE
            else:
                dist.recv(plain, src=groups.weight_source, group=groups.weight_group)
                moved = plain.numel() * ITEMSIZE
            synchronize(device)
            accounted = plain.numel() * ITEMSIZE
        elif groups.is_train:
            assert shards is not None
            report = resharders[method].send(shards, version=version)
            accounted, moved = report.peak_extra_bytes, report.sent_bytes
            split = [
                sum(getattr(b, k) for b in report.buckets) for k in ("gather_s", "slice_s", "transfer_s")
            ]
        else:
            resharder = resharders[method]
            _, announced = resharder.receive_header()
            report = resharder.receive(out[method], version=announced)
            accounted, moved = report.peak_extra_bytes, report.received_bytes
        seconds = time.perf_counter() - t0
    return seconds, accounted, measured.peak, moved, split


def _matches_full_model(resharder: Resharder, t: int, out: dict[str, torch.Tensor]) -> bool:
    """Every piece of inference rank ``t`` in ``out`` equals its rectangle of the full model."""
    pieces = resharder.plan.pieces[t]
    ok = True
    for p, full in full_tensors(resharder.spec):
        for piece in (q for q in pieces if q.source == p.name):
            got = rect_in(out[piece.target], piece.target_rect(), (0,) * full.dim())
            ok = ok and torch.equal(got.cpu(), rect_in(full, piece.source_rect, (0,) * full.dim()))
    return ok


def disaggregated_rank(
    rank: int, world: int, args: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    R = args.world
    spec = ModelShardingSpec.from_config(model_config(args))
    layout = TrainLayout(R)
    shards = train_shards(spec, layout, rank, device) if rank < R else None
    configs = method_configs(args)
    methods = (*configs, PLAIN)
    result: dict[str, Any] = {
        "role": "train" if rank < R else "generate",
        "params": spec.numel(),
        "setups": {},
    }
    for setup in args.setups:
        topology = Topology.disaggregated(layout, *parse_setup(setup))
        groups = build_rank_groups(topology)
        resharders = {m: Resharder(spec, groups, config=c, device=device) for m, c in configs.items()}
        chunked = resharders["chunked"]
        out: dict[str, dict[str, torch.Tensor]] = {}
        destinations: list[tuple[int, int]] = []
        if groups.is_train:
            targets = [topology.inference_coords(g)[0] for g in groups.weight_destinations]
            destinations = [
                (g, slice_numel(chunked, t)) for g, t in zip(groups.weight_destinations, targets, strict=True)
            ]
            plain = torch.ones(max((n for _, n in destinations), default=0), device=device)  # resident
        else:
            targets = [groups.inference_rank] if groups.inference_rank is not None else []
            plain = torch.ones(slice_numel(chunked, targets[0]), device=device)
            out = {
                m: {n: torch.zeros(s, device=device) for n, s in r.inference_shapes().items()}
                for m, r in resharders.items()
            }
        samples: dict[str, dict[str, list[Any]]] = {m: {k: [] for k in SAMPLE_KEYS} for m in methods}
        for rep, order in interleaved(methods, args.repeats):  # rep 0 warms up (pages, gloo buffers)
            for method in order:
                figures = _one_call(
                    method, groups, resharders, shards, out, plain, destinations, device, rep + 1
                )
                if rep > 0:
                    for key, value in zip(SAMPLE_KEYS, figures, strict=True):
                        samples[method][key].append(value)
        record: dict[str, Any] = {
            "samples": samples,
            "largest_bucket_bytes": chunked.largest_bucket_bytes(),
            "buckets": len(chunked.buckets),
            "messages": {m: max((messages(r, t) for t in targets), default=0) for m, r in resharders.items()},
        }
        if out:
            t = targets[0]
            record["slices_equal"] = all(
                torch.equal(out["naive"][n], out[m][n]) for m in out for n in out[m]
            ) and _matches_full_model(chunked, t, out["naive"])
        result["setups"][setup] = record
        del out, plain
    return result


def _aggregate(setup_results: list[dict[str, Any]], method: str) -> dict[str, Any]:
    """One method's figures over the ranks: time = slowest rank per repeat; per role, accounted peak
    = max over ranks and repeats, measured growth and bytes = max over the role's ranks per repeat."""
    per_rank = [(r["role"], r["samples"][method]) for r in setup_results]
    n = len(per_rank[0][1]["s"])

    def by_repeat(role: str, key: str) -> list[float]:
        return [max(s[key][i] for rl, s in per_rank if rl == role) for i in range(n)]

    def split_ms(k: int) -> float:  # median over repeats of the slowest train rank's part k
        return spread(max(s["split"][i][k] for rl, s in per_rank if rl == "train") * 1e3 for i in range(n))[
            "median"
        ]

    return {
        "time_ms": spread(max(s["s"][i] for _, s in per_rank) * 1e3 for i in range(n)),
        "sender_peak_extra_mib": max(by_repeat("train", "acc")) / MIB,
        "receiver_peak_extra_mib": max(by_repeat("generate", "acc")) / MIB,
        "sender_rss_growth_mib": spread(x / MIB for x in by_repeat("train", "meas")),
        "receiver_rss_growth_mib": spread(x / MIB for x in by_repeat("generate", "meas")),
        "mib_per_destination": max(by_repeat("generate", "bytes")) / MIB,
        "mib_sent_per_train_rank": max(by_repeat("train", "bytes")) / MIB,
        "sender_split_ms": {"gather": split_ms(0), "fill_chunks": split_ms(1), "send": split_ms(2)},
    }


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument(
        "--setups",
        nargs="+",
        default=["1x2", "2x1"],
        help="inference layouts TxREPLICAS (T ranks x replicas)",
    )
    parser.add_argument(
        "--staging-mib",
        type=int,
        default=32,
        help="extra chunked row with this staging chunk in MiB (0: none)",
    )
    args = parser.parse_args()
    R = args.world
    worlds: dict[int, list[str]] = {}
    for setup in args.setups:
        T, replicas = parse_setup(setup)
        worlds.setdefault(R + T * replicas, []).append(setup)
    check_devices(args, max(worlds))

    started = time.perf_counter()
    results: dict[str, list[dict[str, Any]]] = {}
    params = 0
    for world, setups in worlds.items():  # one spawned world per process count
        ranks = spawn_world(disaggregated_rank, world, argparse.Namespace(**{**vars(args), "setups": setups}))
        params = ranks[0]["params"]
        results.update({s: [r["setups"][s] | {"role": r["role"]} for r in ranks] for s in setups})

    methods = (*method_configs(args), PLAIN)
    chunk_bytes = ReshardConfig(bucket_bytes=args.bucket_mib * MIB).staging_numel(ITEMSIZE) * ITEMSIZE
    print(
        f"disaggregated reshard benchmark: {params / 1e6:.1f}M params fp32, R={R} train ranks ({args.device}) "
        f"-> generation workers, bucket cap {args.bucket_mib} MiB (chunk {chunk_bytes / MIB:g} MiB), "
        f"{args.repeats} repeats; times in ms median [min, max] (slowest process), bytes in MiB; "
        f"plain_send peaks are its preallocated buffers"
    )
    rows, per_setup = [], {}
    for setup, ranks in results.items():
        T, replicas = parse_setup(setup)
        label = f"T={T} x{replicas}"
        train = next(r for r in ranks if r["role"] == "train")
        figures = {
            m: _aggregate(ranks, m) | {"messages_per_destination": train["messages"].get(m, 1)}
            for m in methods
        }
        for m, f in figures.items():
            paren = "({:.1f})" if m == PLAIN else "{:.1f}"
            rows.append(
                [
                    label,
                    m,
                    fmt_spread(f["time_ms"]),
                    paren.format(f["sender_peak_extra_mib"]),
                    fmt_spread(f["sender_rss_growth_mib"]),
                    paren.format(f["receiver_peak_extra_mib"]),
                    fmt_spread(f["receiver_rss_growth_mib"]),
                    f"{f['mib_per_destination']:.1f}",
                    f["messages_per_destination"],
                ]
            )
        bucket_mib = train["largest_bucket_bytes"] / MIB
        chunked, naive, plain = figures["chunked"], figures["naive"], figures[PLAIN]
        ratio = {
            "sender_peak_vs_bucket_plus_chunk": chunked["sender_peak_extra_mib"]
            / (bucket_mib + chunk_bytes / MIB),
            "receiver_peak_vs_chunk": chunked["receiver_peak_extra_mib"] / (chunk_bytes / MIB),
            "sender_peak_vs_naive": chunked["sender_peak_extra_mib"] / naive["sender_peak_extra_mib"],
            "receiver_peak_vs_naive": chunked["receiver_peak_extra_mib"] / naive["receiver_peak_extra_mib"],
            "time_vs_plain_send": chunked["time_ms"]["median"] / plain["time_ms"]["median"],
            "time_vs_naive": chunked["time_ms"]["median"] / naive["time_ms"]["median"],
            "naive_time_vs_plain_send": naive["time_ms"]["median"] / plain["time_ms"]["median"],
        }
        for m in methods[1:-2]:  # the extra staging rows
            ratio[f"{m}_time_vs_plain_send"] = figures[m]["time_ms"]["median"] / plain["time_ms"]["median"]
        equal = all(r["slices_equal"] for r in ranks if r["role"] == "generate")
        per_setup[setup] = {
            "label": label,
            "figures": figures,
            "ratio": ratio,
            "buckets": train["buckets"],
            "largest_bucket_mib": bucket_mib,
            "slices_equal": equal,
        }
    print_table(
        [
            "layout",
            "method",
            "time ms",
            "sender peak (acc.)",
            "sender RSS growth",
            "receiver peak (acc.)",
            "receiver RSS growth",
            "MiB/dest",
            "msgs/dest",
        ],
        rows,
    )
    for d in per_setup.values():
        r = d["ratio"]
        print(
            f"{d['label']}: {d['buckets']} buckets (largest {d['largest_bucket_mib']:.1f} MiB); sender peak vs "
            f"bucket + chunk {r['sender_peak_vs_bucket_plus_chunk']:.2f}, vs naive {r['sender_peak_vs_naive']:.3f}; "
            f"receiver peak vs chunk {r['receiver_peak_vs_chunk']:.2f}, vs naive {r['receiver_peak_vs_naive']:.3f}; "
            f"time vs plain send {r['time_vs_plain_send']:.2f}x (naive {r['naive_time_vs_plain_send']:.2f}x), "
            f"vs naive {r['time_vs_naive']:.2f}x; slices equal: {d['slices_equal']}"
        )
        parts = (
            f"{m} {f['sender_split_ms']['gather']:.0f} / {f['sender_split_ms']['fill_chunks']:.0f} / "
            f"{f['sender_split_ms']['send']:.0f}"
            for m, f in d["figures"].items()
            if m != PLAIN
        )
        print(
            f"{d['label']}: sender time split gather / fill chunks / send, ms (slowest train rank): "
            + "; ".join(parts)
        )
    print(f"wall {time.perf_counter() - started:.0f} s")

    target = {
        "sender_peak_vs_bucket_plus_chunk_max": 1.0,
        "receiver_peak_vs_chunk_max": 1.0,
        "time_vs_plain_send_max": 1.5,
    }
    ratios = [d["ratio"] for d in per_setup.values()]
    met = {
        "sender_peak": all(r["sender_peak_vs_bucket_plus_chunk"] <= 1.0 for r in ratios),
        "receiver_peak": all(r["receiver_peak_vs_chunk"] <= 1.0 for r in ratios),
        "time": all(r["time_vs_plain_send"] <= 1.5 for r in ratios),
        "slices_equal": all(d["slices_equal"] for d in per_setup.values()),
    }
    print_json_line(
        "reshard_disaggregated",
        {s: {m: f for m, f in d["figures"].items() if m not in BASELINES} for s, d in per_setup.items()},
        {s: {m: d["figures"][m] for m in BASELINES} for s, d in per_setup.items()},
        {s: d["ratio"] for s, d in per_setup.items()},
        target,
        met=met,
        device=args.device,
        params=params,
        train_ranks=R,
        bucket_mib=args.bucket_mib,
        chunk_mib=chunk_bytes / MIB,
        staging_mib_extra_row=args.staging_mib or None,
    )


if __name__ == "__main__":
    main()
