#!/usr/bin/env python3
"""The dock's tensor codec on a stage's micro-batch, against a value-by-value codec, side by side.

Every hop of the pipeline encodes its columns twice and decodes them twice (the client's put and
the warehouse's reception, the warehouse's reply to a fetch and the client's reception), so at
small models the codec's cost per *value* is a visible part of a step. streamrl's codec
(``streamrl.dock.codec``) copies a column's small tensors into the pack frame with one
``torch.cat`` and cuts them out of a received frame with one ``split``, validating a column laid
out back to back as one span. The baseline, written here, is the straightforward codec of the
same wire format (docs/dock-protocol.md §5.2): each value copied to its own 16-byte-aligned offset,
each received value validated and viewed on its own (what streamrl's codec did before 9c9adae).

**The warehouse's side** (ops ``store`` and ``serve``): a warehouse decodes each put as it stores
it and encodes each get's reply. It keeps the values as bytes (``codec.RawValue``: no torch in
the process); the baseline is the same codec making torch views of them, which is what the
warehouse did before it stopped importing torch. Both replies are checked to be byte-equal.

Shapes: W1's micro-batch (64 samples, 4 response tokens and 4 logprobs each) and W2's (128
samples, 40 and 40). Each figure is the median time of one encode or one decode over ``--iters``
calls, per repetition; the table shows the median [min, max] over ``--reps`` repetitions. Both
decoders are checked to return the same values.

    python ops/bench/dock_codec.py                # about 10 seconds
    python ops/bench/dock_codec.py --reps 5 --iters 400
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from _common import fmt_spread, print_json_line, print_table, ratio, spread

from streamrl.dock.codec import ALIGN, decode_columns, decode_put, dtype_name, encode_columns
from streamrl.dock.protocol import TensorColumn

SHAPES = {"W1": (64, 4), "W2": (128, 40)}  # samples, tokens per sample


def columns_of(samples: int, tokens: int) -> dict[str, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return {"response_ids": [torch.randint(0, 50, (tokens,), generator=gen) for _ in range(samples)],
            "rollout_logprobs": [torch.randn(tokens, generator=gen) for _ in range(samples)]}


def naive_encode(columns: dict[str, list[torch.Tensor]], n: int) -> tuple[list[TensorColumn], list[Any]]:
    """Every value to its own ALIGN-aligned offset of one pack frame (all values small here)."""
    header, parts, size = [], [], 0
    for name, values in columns.items():
        shapes, offsets = [], []
        for v in values:
            v = v.contiguous()
            pad = (-size) % ALIGN
            if pad:
                parts.append(np.zeros(pad, np.uint8))
                size += pad
            shapes.append(list(v.shape))
            offsets.append(size)
            parts.append(v.reshape(-1).view(torch.uint8).numpy())
            size += v.numel() * v.element_size()
        header.append(TensorColumn(name, dtype_name(values[0].dtype), shapes, [0] * n, offsets))
    return header, [memoryview(np.concatenate(parts))]


def naive_decode(header: list[TensorColumn], frames: list[Any], n: int) -> dict[str, list[torch.Tensor]]:
    """Each value validated and viewed on its own."""
    raw = [torch.frombuffer(bytearray(f), dtype=torch.uint8) for f in frames]
    out: dict[str, list[torch.Tensor]] = {}
    for col in header:
        dtype = getattr(torch, col.dtype)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        values = []
        for shape, fid, off in zip(col.shapes, col.frames, col.offsets, strict=True):
            if not 0 <= fid < len(raw) or any(d < 0 for d in shape):
                raise ValueError("bad value")
            nbytes = math.prod(shape) * itemsize
            if off < 0 or off % itemsize or off + nbytes > raw[fid].numel():
                raise ValueError("bad value")
            values.append(raw[fid][off : off + nbytes].view(dtype).reshape(shape))
        out[col.name] = values
    return out


def streamrl_decode(header: list[TensorColumn], frames: list[Any], n: int) -> dict[str, list[torch.Tensor]]:
    return decode_columns(header, [bytearray(f) for f in frames], n, exact=True)


def store(header: list[TensorColumn], frames: list[Any], n: int, raw: bool) -> dict[str, list[Any]]:
    """What a warehouse does with a put: decode it, exact, counting the frames each value holds."""
    return decode_put(header, frames, n, raw=raw)[0]


def time_median(fn: Callable[[], Any], iters: int) -> float:
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--iters", type=int, default=200, help="calls timed per figure and repetition")
    args = ap.parse_args()
    torch.set_num_threads(1)  # as in the dock's processes (the warehouse; the workers' event loop thread)
    runs: dict[str, list[float]] = {}
    for _ in range(args.reps):
        for shape, (samples, tokens) in SHAPES.items():
            cols = columns_of(samples, tokens)
            ours_h, ours_f = encode_columns(cols, samples)
            base_h, base_f = naive_encode(cols, samples)
            a, b = streamrl_decode(ours_h, ours_f, samples), naive_decode(base_h, base_f, samples)
            assert all(torch.equal(x, y) for name in cols for x, y in zip(a[name], b[name], strict=True))
            for side, enc, dec, h, f in (("streamrl", encode_columns, streamrl_decode, ours_h, ours_f),
                                         ("naive", naive_encode, naive_decode, base_h, base_f)):
                runs.setdefault(f"{shape}_{side}_encode_ms", []).append(
                    time_median(lambda enc=enc, cols=cols, n=samples: enc(cols, n), args.iters))
                runs.setdefault(f"{shape}_{side}_decode_ms", []).append(
                    time_median(lambda dec=dec, h=h, f=f, n=samples: dec(h, f, n), args.iters))
            # the warehouse: bytes (streamrl) against torch views of them (naive: its path before)
            received = [bytes(f) for f in ours_f]
            held = {raw: store(ours_h, received, samples, raw) for raw in (True, False)}
            replies = {raw: encode_columns(held[raw], samples) for raw in (True, False)}
            assert replies[True][0] == replies[False][0]
            assert [bytes(f) for f in replies[True][1]] == [bytes(f) for f in replies[False][1]]
            for side, raw in (("streamrl", True), ("naive", False)):
                runs.setdefault(f"{shape}_{side}_store_ms", []).append(
                    time_median(lambda raw=raw, h=ours_h, f=received, n=samples: store(h, f, n, raw), args.iters))
                runs.setdefault(f"{shape}_{side}_serve_ms", []).append(
                    time_median(lambda v=held[raw], n=samples: encode_columns(v, n), args.iters))
    figures = {k: spread(v) for k, v in runs.items() if "_streamrl_" in k}
    baseline = {k.replace("_naive_", "_"): spread(v) for k, v in runs.items() if "_naive_" in k}
    ratios = {k.replace("_streamrl_", "_"): round(ratio(baseline[k.replace("_streamrl_", "_")], s), 2)
              for k, s in figures.items()}
    rows = []
    for shape in SHAPES:
        for op, base in (("encode", "value by value"), ("decode", "value by value"),
                         ("store", "torch views"), ("serve", "torch views")):
            key = f"{shape}_{op}_ms"
            rows.append([shape, op, base, fmt_spread(baseline[key], 3),
                         fmt_spread(figures[f"{shape}_streamrl_{op}_ms"], 3), f"{ratios[key]:.2f}x"])
    print_table(["shape", "op", "baseline", "baseline (ms)", "streamrl (ms)", "speed-up"], rows)
    print_json_line("dock_codec", figures, baseline, ratios, {"speed_up_min": 1.0}, reps=args.reps, iters=args.iters)


if __name__ == "__main__":
    main()
