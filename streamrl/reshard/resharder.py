"""The allgather-swap reshard: training shards -> inference TP slices, one bucket at a time.

For each bucket (consecutive training parameters in layer order, at most ``bucket_bytes``
once gathered), using one buffer sized for the largest bucket and reused by all of them:

1. pack this rank's shards of the bucket into *its own slot* of the buffer, then all-gather in
   place over the train group (:func:`~streamrl.reshard.collectives.all_gather_in_place`);
2. view every rank's slot as that rank's shard of each parameter (no copy);
3. copy each inference piece (a rectangle of a full tensor, see :mod:`spec`) straight from the
   shards that cover it into the inference weights (colocated), or stream it to the generation
   worker that holds it (disaggregated, below);
4. go on with the next bucket; the buffer is released at the end.

Disaggregated, a destination's slice of a bucket is a flat stream: its pieces of that bucket in
plan order, each flattened row-major in its own shape. The stream is cut into chunks of at most
``staging_bytes`` (:meth:`ReshardConfig.staging_numel`), and each chunk is filled from the
shards, sent, received and scattered into the worker's weights through one reused staging chunk
per side. A chunk boundary may fall inside a piece: the piece's flat range in that chunk is
copied as at most 3 row-aligned rectangles (:func:`~streamrl.reshard.shards.flat_range_rects`).
Both sides cut the same plan with the same chunk size, so every send matches a recv of the same
size and nothing but the weights travels.

Nothing ever holds a full parameter or the full model, so the peak extra memory per rank is one
gathered bucket (+ one staging chunk when sending); a generation worker's is one staging chunk.
The same code with a single bucket for the whole model is the naive reshard used as the
baseline (there, by default, the staging is not chunked either).

Everything here is blocking (collectives, copies); :mod:`streamrl.reshard.policy` runs it in a
worker thread so that ``await`` never blocks the event loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from math import prod

import torch
import torch.distributed as dist

from streamrl.reshard.accounting import BucketStats, MemoryTracker, ReshardReport
from streamrl.reshard.collectives import accelerator, all_gather_in_place, synchronize
from streamrl.reshard.groups import RankGroups
from streamrl.reshard.layout import LayoutError, TrainLayout
from streamrl.reshard.shards import (
    copy_rect,
    flat_range_rects,
    local_shape,
    rect_in,
    source_blocks,
    train_block,
)
from streamrl.reshard.spec import ModelShardingSpec, ParamSpec, Piece, Rect, full_rect, rect_shape

HEADER_WEIGHTS = 1  # header kind: a new policy version follows, bucket by bucket
HEADER_CLOSE = 2  # header kind: the sender is shutting down; no more versions
DEFAULT_STAGING_CAP = 4 * 2**20  # bytes: the default staging chunk is min(bucket_bytes // 8, this)


def _positive_bytes(name: str, value: object, none_means: str) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(
            f"{name} must be a positive integer number of bytes or None ({none_means}), got {value!r}"
        )


@dataclass(frozen=True)
class ReshardConfig:
    """bucket_bytes: cap, in bytes, on one bucket once gathered (R x local shard bytes). It is the
    reshard's peak transient memory per rank: larger buckets mean fewer, larger collectives (less
    per-call latency), smaller ones less memory. A parameter larger than the cap forms its own
    bucket. None puts the whole model in one bucket: the naive gather-everything reshard.

    staging_bytes: cap, in bytes, on the staging chunk through which a disaggregated reshard
    sends (and receives) a destination's slice of a bucket; the chunk holds
    ``staging_bytes // itemsize`` elements of the inference dtype (at least one element's worth
    is required). None (default) derives it: ``min(bucket_bytes // 8, 4 MiB)``, or, with
    ``bucket_bytes=None`` (naive), no chunking: one staging buffer for the largest slice. The
    sender and its receivers must use the same value (both read it from this config); smaller
    chunks mean more, smaller point-to-point messages. Colocated reshards stage nothing.
    """

    bucket_bytes: int | None = 64 * 2**20
    staging_bytes: int | None = None

    def __post_init__(self) -> None:
        _positive_bytes("bucket_bytes", self.bucket_bytes, "whole model")
        _positive_bytes("staging_bytes", self.staging_bytes, "derived from bucket_bytes")

    def staging_numel(self, itemsize: int) -> int | None:
        """Elements per staging chunk for an inference dtype of ``itemsize`` bytes (None: unbounded)."""
        if self.staging_bytes is not None:
            if self.staging_bytes < itemsize:
                raise ValueError(
                    f"staging_bytes={self.staging_bytes} is smaller than one element of the inference "
                    f"dtype ({itemsize} bytes)"
                )
            return self.staging_bytes // itemsize
        if self.bucket_bytes is None:
            return None
        return max(1, min(self.bucket_bytes // 8, DEFAULT_STAGING_CAP) // itemsize)


@dataclass(frozen=True)
class Bucket:
    index: int
    params: tuple[ParamSpec, ...]
    offsets: tuple[int, ...]  # element offset of each parameter's shard in a rank's packed slot
    local_numel: int  # elements of one rank's packed slot

    def gathered_bytes(self, world_size: int, itemsize: int) -> int:
        return self.local_numel * world_size * itemsize


def plan_buckets(
    params: tuple[ParamSpec, ...], layout: TrainLayout, bucket_bytes: int | None, itemsize: int
) -> tuple[Bucket, ...]:
    """Greedy split of the parameters, in order, into buckets of at most ``bucket_bytes`` gathered."""
    buckets: list[Bucket] = []
    current: list[ParamSpec] = []
    offsets: list[int] = []
    numel = 0
    for p in params:
        n = torch.Size(local_shape(p, layout)).numel()
        gathered = (numel + n) * layout.world_size * itemsize
        if current and bucket_bytes is not None and gathered > bucket_bytes:
            buckets.append(Bucket(len(buckets), tuple(current), tuple(offsets), numel))
            current, offsets, numel = [], [], 0
        current.append(p)
        offsets.append(numel)
        numel += n
    if current:
        buckets.append(Bucket(len(buckets), tuple(current), tuple(offsets), numel))
    return tuple(buckets)


ShardViews = dict[str, list[tuple[Rect, torch.Tensor]]]
Segment = tuple[Piece, int, int]  # a piece and the flat range [start, stop) of it in one chunk


def cut_chunks(pieces: list[Piece], chunk_numel: int) -> Iterator[tuple[int, list[Segment]]]:
    """Cut the flat stream of ``pieces`` (in order, each row-major in its shape) into chunks.

    Yields (elements, segments) per chunk: every chunk but the last holds exactly ``chunk_numel``
    elements. Sender and receiver both call this on the same plan, so their chunks match.
    """
    if chunk_numel < 1:
        raise ValueError(f"a chunk must hold at least one element, got {chunk_numel}")
    segments: list[Segment] = []
    filled = 0
    for piece in pieces:
        start = 0
        while start < piece.numel:
            stop = min(piece.numel, start + chunk_numel - filled)
            segments.append((piece, start, stop))
            filled += stop - start
            start = stop
            if filled == chunk_numel:
                yield filled, segments
                segments, filled = [], 0
    if filled:
        yield filled, segments


def chunk_views(
    chunk: torch.Tensor, segments: list[Segment], rect_of: Callable[[Piece], Rect]
) -> Iterator[tuple[Piece, Rect, torch.Tensor]]:
    """(piece, sub-rectangle, view of ``chunk`` shaped like it) for each row-aligned part of a chunk.

    ``rect_of`` picks the coordinates the sub-rectangles are in: ``Piece.source_rect`` (the full
    training tensor, sender) or ``Piece.target_rect`` (the inference weight, receiver); the flat
    order, hence the chunk offsets, is the same for both.
    """
    offset = 0
    for piece, start, stop in segments:
        for sub in flat_range_rects(rect_of(piece), start, stop):
            shape = rect_shape(sub)
            n = prod(shape)
            yield piece, sub, chunk[offset : offset + n].view(shape)
            offset += n


def _source_rect(piece: Piece) -> Rect:
    return piece.source_rect


class Resharder:
    """Bucketed allgather reshard for one rank of a :class:`~streamrl.reshard.groups.RankGroups`.

    shard_dtype: dtype of the training shards (all parameters share it: the bucket is one flat
    buffer). inference_dtype: dtype of the inference weights; the cast happens in the slice copy,
    so a bf16 inference copy of fp32 training weights costs no extra buffer (and, disaggregated,
    the staging chunks and the wire carry the inference dtype).
    """

    def __init__(
        self,
        spec: ModelShardingSpec,
        groups: RankGroups,
        *,
        config: ReshardConfig = ReshardConfig(),
        shard_dtype: torch.dtype = torch.float32,
        inference_dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.spec, self.groups, self.config = spec, groups, config
        self.topology = groups.topology
        self.layout = self.topology.train
        spec.check_train_layout(self.layout)
        self.plan = spec.inference_plan(self.topology.inference.tensor_parallel)
        self.shard_dtype = shard_dtype
        self.inference_dtype = inference_dtype or shard_dtype
        self.device = torch.device(device)
        itemsize = torch.empty((), dtype=shard_dtype).element_size()
        self._itemsize = itemsize
        self._out_itemsize = torch.empty((), dtype=self.inference_dtype).element_size()
        self._chunk_numel = config.staging_numel(self._out_itemsize)  # validates staging_bytes
        self.buckets = plan_buckets(spec.params, self.layout, config.bucket_bytes, itemsize)
        self._local_shapes = {p.name: local_shape(p, self.layout) for p in spec.params}
        self._sources = {p.name: source_blocks(p, self.layout) for p in spec.params}
        # pieces[t][bucket index]: the pieces of inference rank t whose source lies in that bucket
        bucket_of = {p.name: b.index for b in self.buckets for p in b.params}
        self._pieces: list[list[list[Piece]]] = []
        for rank_pieces in self.plan.pieces:
            per_bucket: list[list[Piece]] = [[] for _ in self.buckets]
            for piece in rank_pieces:
                per_bucket[bucket_of[piece.source]].append(piece)
            self._pieces.append(per_bucket)

    # -- shapes of what the inference side holds ------------------------------------------------
    def inference_shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self.plan.shapes)

    def largest_bucket_bytes(self) -> int:
        return max(b.gathered_bytes(self.layout.world_size, self._itemsize) for b in self.buckets)

    def bucket_slice_numel(self, inference_rank: int, bucket: int) -> int:
        return sum(p.numel for p in self._pieces[inference_rank][bucket])

    def staging_numel(self, inference_ranks: list[int]) -> int:
        """Elements of the staging chunk for sending to (or receiving as) these inference ranks:
        the configured chunk, or less when no bucket slice of theirs is that large."""
        largest = max(
            (self.bucket_slice_numel(t, b.index) for t in inference_ranks for b in self.buckets), default=0
        )
        return largest if self._chunk_numel is None else min(largest, self._chunk_numel)

    def chunks(self, inference_rank: int, bucket: int) -> Iterator[tuple[int, list[Segment]]]:
        """The chunks, in wire order, of one destination's slice of one bucket (see :func:`cut_chunks`)."""
        size = self._chunk_numel or self.bucket_slice_numel(inference_rank, bucket)  # None: one chunk
        return cut_chunks(self._pieces[inference_rank][bucket], max(1, size))

    # -- train side -----------------------------------------------------------------------------
    def _check_shards(self, shards: Mapping[str, torch.Tensor]) -> None:
        """Each shard must be this rank's block of the layout: either padded to the common shape, or
        (FSDP2's ``to_local()``) exactly the rows it really holds, which the last ranks may lack."""
        rank = self.groups.train.rank if self.groups.train is not None else 0
        for p in self.spec.params:
            shard = shards.get(p.name)
            if shard is None:
                raise KeyError(f"training shards lack {p.name!r}")
            padded = self._local_shapes[p.name]
            block = train_block(p, self.layout, rank)
            held = (0, *padded[1:]) if block.rect is None else rect_shape(block.rect)
            if tuple(shard.shape) not in (padded, held) or shard.dtype != self.shard_dtype:
                raise ValueError(
                    f"{p.name}: shard is {tuple(shard.shape)} {shard.dtype}, the layout needs {padded} (padded) "
                    f"or {held} (unpadded) {self.shard_dtype}"
                )

    def _gathered_buckets(
        self, shards: Mapping[str, torch.Tensor], tracker: MemoryTracker, report: ReshardReport
    ) -> Iterator[tuple[Bucket, ShardViews, BucketStats]]:
        groups = self.groups
        if groups.train is None:
            raise LayoutError(f"world rank {groups.world_rank} is not a train rank; it cannot gather shards")
        rank, R = groups.train.rank, self.layout.world_size
        # One buffer sized for the largest bucket, reused by every bucket: the peak is exactly one
        # bucket, and the allocator is not asked for (and does not fault in) fresh memory per bucket.
        buffer = torch.empty(
            max(b.local_numel for b in self.buckets) * R, dtype=self.shard_dtype, device=self.device
        )
        buffer_bytes = buffer.numel() * self._itemsize
        tracker.allocate(buffer_bytes)
        try:
            for bucket in self.buckets:
                n = bucket.local_numel
                stats = BucketStats(bucket.index, len(bucket.params))
                report.buckets.append(stats)
                t0 = time.perf_counter()
                gathered = buffer[: R * n]
                stats.gathered_bytes = gathered.numel() * self._itemsize
                own = gathered[rank * n : (rank + 1) * n]
                for p, offset in zip(bucket.params, bucket.offsets, strict=True):
                    own[offset : offset + shards[p.name].numel()].copy_(
                        shards[p.name].reshape(-1), non_blocking=True
                    )
                all_gather_in_place(gathered, groups.reshard_group)
                synchronize(self.device)
                stats.gather_s = time.perf_counter() - t0
                stats.received_bytes = (R - 1) * n * self._itemsize
                views: ShardViews = {}
                for p, offset in zip(bucket.params, bucket.offsets, strict=True):
                    views[p.name] = [
                        (
                            b.rect,
                            gathered[r * n + offset : r * n + offset + b.local_numel].view(b.local_shape),
                        )
                        for r, b in self._sources[p.name]
                    ]
                stats.peak_extra_bytes = tracker.live_bytes
                yield bucket, views, stats
                del views, own, gathered
        finally:
            del buffer
            tracker.release(buffer_bytes)

    def reshard_local(
        self, shards: Mapping[str, torch.Tensor], out: Mapping[str, torch.Tensor], *, version: int
    ) -> ReshardReport:
        """Colocated: fill ``out`` (this rank's inference weights) from the train group's shards."""
        t = self.groups.inference_rank
        if t is None or self.topology.placement != "colocated":
            raise LayoutError("reshard_local is the colocated path; this rank holds no local inference rank")
        self._check_shards(shards)
        self._check_out(out)
        tracker = MemoryTracker()
        report = ReshardReport(version, "colocated", self.config.bucket_bytes)
        with self._measure(report, tracker):
            for bucket, views, stats in self._gathered_buckets(shards, tracker, report):
                t0 = time.perf_counter()
                for piece in self._pieces[t][bucket.index]:
                    copied = copy_rect(
                        out[piece.target], piece.target_origin, piece.source_rect, views[piece.source]
                    )
                    stats.sliced_bytes += copied * self._out_itemsize
                synchronize(self.device)
                stats.slice_s = time.perf_counter() - t0
        return report

    def reshard_local_stream(
        self, shards: Mapping[str, torch.Tensor], report: ReshardReport
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Colocated, T = 1: the train group's shards as whole Hugging Face-named parameters,
        yielded a bucket at a time as each bucket's all-gather completes.

        For an engine in this process that loads Hugging Face weights itself (vLLM): no inference
        copy is kept here. Buffer lifetimes: the one gather buffer of :meth:`_gathered_buckets`
        (reused by every bucket, so the views into it die with the bucket), and each bucket's
        parameter tensors, fresh per bucket and never overwritten (the consumer may keep the
        previous bucket's until it has copied them). Peak extra memory: one gathered bucket and one
        bucket of parameters. Collective: every train rank must consume the stream to the end.
        """
        if self.topology.placement != "colocated" or self.topology.inference.tensor_parallel != 1:
            raise LayoutError("reshard_local_stream yields whole Hugging Face parameters: colocated, T = 1 only")
        self._check_shards(shards)
        tracker = MemoryTracker()
        with self._measure(report, tracker):
            for bucket, views, stats in self._gathered_buckets(shards, tracker, report):
                t0 = time.perf_counter()
                params = {p.name: torch.empty(p.shape, dtype=self.inference_dtype, device=self.device)
                          for p in bucket.params}
                params_bytes = sum(t.numel() for t in params.values()) * self._out_itemsize
                tracker.allocate(params_bytes)
                stats.peak_extra_bytes = tracker.live_bytes
                for name, full in params.items():
                    copied = copy_rect(full, (0,) * full.dim(), full_rect(full.shape), views[name])
                    stats.sliced_bytes += copied * self._out_itemsize
                synchronize(self.device)
                del views  # the gather buffer is the next bucket's: nothing may still point into it
                stats.slice_s = time.perf_counter() - t0
                yield from params.items()
                del params  # the consumer has copied them (an engine's load_weights copies as it reads)
                tracker.release(params_bytes)

    def send(self, shards: Mapping[str, torch.Tensor], *, version: int) -> ReshardReport:
        """Disaggregated train rank: gather bucket by bucket, stream each destination its slices.

        Per bucket and destination, the slice goes out chunk by chunk (:meth:`chunks`) through
        one staging chunk reused by every chunk, destination and bucket: the peak extra memory is
        one gathered bucket + one chunk.
        """
        groups = self.groups
        if self.topology.placement != "disaggregated":
            raise LayoutError("send is the disaggregated path; use reshard_local when colocated")
        self._check_shards(shards)
        self.send_header(HEADER_WEIGHTS, version)
        destinations = [(g, self.topology.inference_coords(g)[0]) for g in groups.weight_destinations]
        tracker = MemoryTracker()
        report = ReshardReport(version, "sender", self.config.bucket_bytes)
        staging_numel = self.staging_numel([t for _, t in destinations])
        with self._measure(report, tracker):
            staging = torch.empty(staging_numel, dtype=self.inference_dtype, device=self.device)
            staging_bytes = staging_numel * self._out_itemsize
            tracker.allocate(staging_bytes)
            for bucket, views, stats in self._gathered_buckets(shards, tracker, report):
                t0 = time.perf_counter()
                stats.staging_bytes = staging_bytes
                stats.peak_extra_bytes = tracker.live_bytes
                for dest, t in destinations:
                    for size, segments in self.chunks(t, bucket.index):
                        chunk = staging[:size]
                        for piece, sub, view in chunk_views(chunk, segments, _source_rect):
                            copy_rect(view, (0,) * view.dim(), sub, views[piece.source])
                        synchronize(self.device)  # the (non_blocking) fills are done before it leaves
                        t1 = time.perf_counter()
                        dist.send(chunk, dst=dest, group=groups.weight_group)
                        stats.transfer_s += time.perf_counter() - t1
                        stats.sent_bytes += size * self._out_itemsize
                stats.slice_s = time.perf_counter() - t0 - stats.transfer_s
            del staging
            tracker.release(staging_bytes)
        return report

    def send_header(self, kind: int, version: int) -> None:
        header = torch.tensor([kind, version], dtype=torch.int64, device=self.device)
        for dest in self.groups.weight_destinations:
            dist.send(header, dst=dest, group=self.groups.weight_group)

    # -- generation side (disaggregated) --------------------------------------------------------
    def receive_header(self) -> tuple[int, int]:
        """Block until this worker's source announces a version (or closes); (kind, version)."""
        source = self._source()
        header = torch.empty(2, dtype=torch.int64, device=self.device)
        dist.recv(header, src=source, group=self.groups.weight_group)
        kind, version = (int(x) for x in header.tolist())
        if kind not in (HEADER_WEIGHTS, HEADER_CLOSE):
            raise RuntimeError(f"weight channel from rank {source} sent an unknown header kind {kind}")
        return kind, version

    def receive(self, out: Mapping[str, torch.Tensor], *, version: int) -> ReshardReport:
        """Receive the buckets of the version announced by :meth:`receive_header` into ``out``.

        Chunk by chunk (the sender's cuts, :meth:`chunks`) into one staging chunk, each scattered
        into the target rectangles of its pieces: the peak extra memory is one chunk.
        """
        source, t = self._source(), self.groups.inference_rank
        assert t is not None
        self._check_out(out)
        tracker = MemoryTracker()
        report = ReshardReport(version, "receiver", self.config.bucket_bytes)
        staging_numel = self.staging_numel([t])
        with self._measure(report, tracker):
            staging = torch.empty(staging_numel, dtype=self.inference_dtype, device=self.device)
            staging_bytes = staging_numel * self._out_itemsize
            tracker.allocate(staging_bytes)
            for bucket in self.buckets:
                if not self.bucket_slice_numel(t, bucket.index):
                    continue
                stats = BucketStats(bucket.index, len(bucket.params))
                report.buckets.append(stats)
                stats.staging_bytes = staging_bytes
                stats.peak_extra_bytes = tracker.live_bytes
                t0 = time.perf_counter()
                for size, segments in self.chunks(t, bucket.index):
                    chunk = staging[:size]
                    t1 = time.perf_counter()
                    dist.recv(chunk, src=source, group=self.groups.weight_group)
                    stats.transfer_s += time.perf_counter() - t1
                    for piece, sub, view in chunk_views(chunk, segments, Piece.target_rect):
                        rect_in(out[piece.target], sub, (0,) * view.dim()).copy_(view, non_blocking=True)
                    synchronize(self.device)  # the next recv overwrites the chunk
                    stats.received_bytes += size * self._out_itemsize
                stats.sliced_bytes = stats.received_bytes
                stats.slice_s = time.perf_counter() - t0 - stats.transfer_s
            del staging
            tracker.release(staging_bytes)
        return report

    def receive_stream(self, report: ReshardReport) -> Iterator[tuple[str, torch.Tensor]]:
        """Receive the version announced by :meth:`receive_header` as Hugging Face-named tensors,
        yielding a bucket's parameters as soon as that bucket is in (T = 1 only).

        For an engine that loads Hugging Face weights itself (vLLM's ``reload_weights``): it copies
        each yielded tensor into its own storage, so no inference copy is kept here. Buffer
        lifetimes: one staging chunk for the whole call, plus the current bucket's parameter
        tensors, which are fresh per bucket (the consumer may still hold the previous bucket's
        until it has copied them; they are never overwritten). Peak extra memory: one bucket and
        one chunk. The stream must be consumed to the end: the sender's sends for this version
        are matched by these receives only.
        """
        if self.topology.inference.tensor_parallel != 1:
            raise LayoutError("receive_stream yields whole Hugging Face parameters: it needs T = 1")
        source, t = self._source(), self.groups.inference_rank
        assert t is not None
        started = time.perf_counter()
        staging = torch.empty(self.staging_numel([t]), dtype=self.inference_dtype, device=self.device)
        for bucket in self.buckets:
            if not self.bucket_slice_numel(t, bucket.index):
                continue
            stats = BucketStats(bucket.index, len(bucket.params))
            report.buckets.append(stats)
            t0 = time.perf_counter()
            params = {p.name: torch.empty(p.shape, dtype=self.inference_dtype, device=self.device)
                      for p in bucket.params}
            for size, segments in self.chunks(t, bucket.index):
                chunk = staging[:size]
                t1 = time.perf_counter()
                dist.recv(chunk, src=source, group=self.groups.weight_group)
                stats.transfer_s += time.perf_counter() - t1
                # source coordinates: with T = 1 a piece is its whole Hugging Face parameter (a tied
                # lm_head's piece rewrites the embedding with the same values)
                for piece, sub, view in chunk_views(chunk, segments, _source_rect):
                    rect_in(params[piece.source], sub, (0,) * view.dim()).copy_(view)
                synchronize(self.device)  # the next recv overwrites the chunk
                stats.received_bytes += size * self._out_itemsize
            stats.sliced_bytes = stats.received_bytes
            stats.slice_s = time.perf_counter() - t0 - stats.transfer_s
            yield from params.items()
        report.total_s = time.perf_counter() - started

    # -- helpers --------------------------------------------------------------------------------
    def _source(self) -> int:
        source = self.groups.weight_source
        if source is None:
            raise LayoutError(f"world rank {self.groups.world_rank} is not a disaggregated generation worker")
        return source

    def _check_out(self, out: Mapping[str, torch.Tensor]) -> None:
        for name, shape in self.plan.shapes.items():
            tensor = out.get(name)
            if tensor is None:
                raise KeyError(f"inference weights lack {name!r}")
            if tuple(tensor.shape) != shape:
                raise ValueError(
                    f"inference weight {name!r} is {tuple(tensor.shape)}, the layout needs {shape}"
                )

    @contextmanager
    def _measure(self, report: ReshardReport, tracker: MemoryTracker) -> Iterator[None]:
        accel = accelerator(self.device)
        base = 0
        if accel is not None:
            accel.synchronize(self.device)
            base = accel.memory_allocated(self.device)
            accel.reset_peak_memory_stats(self.device)
        t0 = time.perf_counter()
        yield
        synchronize(self.device)
        report.total_s = time.perf_counter() - t0
        report.peak_extra_bytes = tracker.peak_bytes
        if accel is not None:
            report.device_peak_extra_bytes = accel.max_memory_allocated(self.device) - base
