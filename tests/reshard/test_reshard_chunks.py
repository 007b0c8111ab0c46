"""Chunked staging of the disaggregated reshard, in one process: no collectives.

:func:`flat_range_rects` is checked against a brute-force flatten, :func:`cut_chunks` against
its contract, and a whole slice is streamed through an odd-sized chunk (filled from the full
weights as the sender does, scattered into the weights as the receiver does) and compared
bitwise with the oracle. The multi-process test runs the same code over gloo.
"""

from __future__ import annotations

import random
from math import prod

import pytest
import torch

from streamrl.reshard import ModelShardingSpec, ReshardConfig
from streamrl.reshard.resharder import DEFAULT_STAGING_CAP, chunk_views, cut_chunks
from streamrl.reshard.shards import copy_rect, flat_range_rects, rect_in
from streamrl.reshard.spec import Piece, Rect, full_rect, rect_shape
from tests.reshard.reshard_harness import build_model, tiny_config
from tests.reshard.reshard_workers import expected_slice


def _check_flat_range(rect: Rect, start: int, stop: int) -> list[Rect]:
    """flat_range_rects(rect, start, stop) reads exactly rect's flattened [start, stop), in order."""
    full_shape = tuple(hi + 1 for _, hi in rect)  # rect sits inside a larger tensor, off its origin
    full = torch.arange(prod(full_shape)).reshape(full_shape)
    want = rect_in(full, rect, (0,) * len(rect)).reshape(-1)[start:stop]
    subs = list(flat_range_rects(rect, start, stop))
    got = [rect_in(full, sub, (0,) * len(rect)).reshape(-1) for sub in subs]
    assert torch.equal(torch.cat(got) if got else want[:0], want), (rect, start, stop, subs)
    for sub in subs:
        assert all(lo < hi and r0 <= lo and hi <= r1 for (lo, hi), (r0, r1) in zip(sub, rect, strict=True))
    if len(rect) == 1:
        assert len(subs) == (1 if stop > start else 0)
    if len(rect) == 2:
        assert len(subs) <= 3
    return subs


def test_flat_range_rects_matches_a_brute_force_flatten_on_random_shapes() -> None:
    rng = random.Random(0)
    for _ in range(400):
        dims = rng.choice([1, 2, 2, 3])
        shape = tuple(rng.randint(1, 7) for _ in range(dims))
        origin = tuple(rng.randint(0, 3) for _ in range(dims))
        rect = tuple((o, o + n) for o, n in zip(origin, shape, strict=True))
        start = rng.randint(0, prod(shape))
        _check_flat_range(rect, start, rng.randint(start, prod(shape)))


def test_flat_range_rects_named_cases() -> None:
    rect = ((2, 6), (3, 8))  # 4 rows of 5
    assert _check_flat_range(rect, 6, 9) == [((3, 4), (4, 7))]  # inside one row
    assert _check_flat_range(rect, 7, 12) == [((3, 4), (5, 8)), ((4, 5), (3, 5))]  # two rows
    assert _check_flat_range(rect, 0, 20) == [rect]  # whole tensor: one rectangle
    assert _check_flat_range(rect, 5, 15) == [((3, 5), (3, 8))]  # whole rows
    assert _check_flat_range(rect, 3, 18) == [((2, 3), (6, 8)), ((3, 5), (3, 8)), ((5, 6), (3, 6))]
    assert _check_flat_range(rect, 7, 7) == [] and _check_flat_range(rect, 20, 20) == []  # empty
    assert _check_flat_range(((4, 10),), 1, 4) == [((5, 8),)]  # 1-D: one range
    with pytest.raises(ValueError, match="not within"):
        list(flat_range_rects(rect, 5, 21))
    with pytest.raises(ValueError, match="not within"):
        list(flat_range_rects(rect, 6, 5))


def _piece(name: str, shape: tuple[int, ...]) -> Piece:
    return Piece(name, name, full_rect(shape), (0,) * len(shape))


@pytest.mark.parametrize("chunk", [1, 5, 7, 64, 1000])
def test_cut_chunks_covers_the_stream_in_order(chunk: int) -> None:
    pieces = [_piece("a", (3, 5)), _piece("b", (7,)), _piece("empty", (0, 4)), _piece("c", (4, 4))]
    chunks = list(cut_chunks(pieces, chunk))
    sizes = [size for size, _ in chunks]
    total = sum(p.numel for p in pieces)
    assert sum(sizes) == total and all(s == chunk for s in sizes[:-1]) and 0 < sizes[-1] <= chunk
    stream = [(piece.source, i) for piece in pieces for i in range(piece.numel)]
    cut = [(piece.source, i) for _, segments in chunks for piece, a, b in segments for i in range(a, b)]
    assert cut == stream
    for size, segments in chunks:
        assert size == sum(b - a for _, a, b in segments) and all(a < b for _, a, b in segments)
    assert list(cut_chunks([], chunk)) == []


def test_cut_chunks_refuses_an_empty_chunk() -> None:
    with pytest.raises(ValueError, match="at least one element"):
        list(cut_chunks([_piece("a", (3,))], 0))


@pytest.mark.parametrize(("T", "chunk"), [(1, 97), (2, 97), (4, 1250), (2, 10_000_000)])
def test_a_slice_streamed_through_an_odd_chunk_is_bitwise_right(T: int, chunk: int) -> None:
    """Sender fill (copy_rect from the source blocks) and receiver scatter (into target rects)."""
    config = tiny_config()
    spec = ModelShardingSpec.from_config(config)
    full = dict(build_model(config).state_dict())
    plan = spec.inference_plan(T)
    for t in range(T):
        want = expected_slice(full, config, T, t)
        out = {name: torch.zeros(shape) for name, shape in plan.shapes.items()}
        pieces = list(plan.pieces[t])
        staging = torch.full((min(chunk, sum(p.numel for p in pieces)),), float("nan"))
        for size, segments in cut_chunks(pieces, chunk):
            sent = staging[:size]
            for piece, sub, view in chunk_views(sent, segments, lambda p: p.source_rect):
                blocks = [(full_rect(tuple(full[piece.source].shape)), full[piece.source])]
                assert copy_rect(view, (0,) * view.dim(), sub, blocks) == view.numel()
            received = sent.clone()
            staging.fill_(float("nan"))  # the receiver's chunk is its own buffer
            for piece, sub, view in chunk_views(received, segments, Piece.target_rect):
                assert rect_shape(sub) == tuple(view.shape)
                rect_in(out[piece.target], sub, (0,) * view.dim()).copy_(view)
        assert [n for n in want if not torch.equal(out[n], want[n])] == [], (T, t, chunk)


def test_staging_bytes_default_and_refusals() -> None:
    assert ReshardConfig().staging_numel(4) == DEFAULT_STAGING_CAP // 4  # 64 MiB buckets: 4 MiB
    assert ReshardConfig(bucket_bytes=40_000).staging_numel(4) == 1250  # bucket_bytes // 8
    assert ReshardConfig(bucket_bytes=40_000).staging_numel(2) == 2500  # bf16: same bytes
    assert ReshardConfig(bucket_bytes=None).staging_numel(4) is None  # naive: not chunked
    assert ReshardConfig(bucket_bytes=None, staging_bytes=4096).staging_numel(4) == 1024
    assert ReshardConfig(bucket_bytes=8).staging_numel(4) == 1  # never zero
    assert ReshardConfig(staging_bytes=7).staging_numel(4) == 1  # rounded down to whole elements
    for bad in (0, -4, 1.5, "4096", True):
        with pytest.raises(ValueError, match="staging_bytes must be a positive integer"):
            ReshardConfig(staging_bytes=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="smaller than one element"):
        ReshardConfig(staging_bytes=3).staging_numel(4)
