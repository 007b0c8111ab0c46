"""The T train ranks of one tensor-parallel model replica train on the same micro-batches.

With ``stages.train.options.tensor_parallel: T`` the R train workers form R / T replicas of T
ranks each (rank = dp_rank * T + tp_rank, the engine's mesh order). A TP forward computes each
layer across the replica's ranks, so all T must feed it the same samples at the same time: only
TP rank 0 (the *leader*) claims from the dock, and it hands every micro-batch to the others (the
*followers*, ``follows = True`` for the runtime) over the replica's tp group before it trains on
it. Nothing else uses that group from the stage.

Each message is ``dist.broadcast`` from the leader:

====================  =======================================================================
``int64[3]``          ``[kind, header bytes, frames]``: kind 1 = a micro-batch, 2 = stop
``int64[frames]``     each frame's length in bytes (micro-batch only)
``uint8[...]``        the msgpack header (the dock codec's columns, plus the samples' policy
                      versions), then the frames (micro-batch only)
====================  =======================================================================

The columns travel in the dock's own wire format (:mod:`streamrl.dock.codec`): typed msgpack and
raw tensor bytes, no pickle, every size checked on decode.
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch
import torch.distributed as dist

from streamrl.dock.codec import decode_columns, encode_columns
from streamrl.dock.protocol import Column

BATCH = 1
STOP = 2


class _Header(msgspec.Struct, forbid_unknown_fields=True):
    n: int
    columns: list[Column]
    versions: list[int]


_decoder = msgspec.msgpack.Decoder(_Header)


class ReplicaChannel:
    """One replica's micro-batch stream (blocking calls: run them in a thread)."""

    def __init__(self, group: dist.ProcessGroup, leader: int) -> None:
        self.group, self.leader = group, leader  # leader: its global rank

    def send(self, columns: dict[str, list[Any]], versions: list[int]) -> None:
        n = len(versions)
        header_columns, frames = encode_columns(columns, n)
        header = msgspec.msgpack.encode(_Header(n, header_columns, versions))
        sizes = [len(memoryview(f).cast("B")) for f in frames]
        dist.broadcast(torch.tensor([BATCH, len(header), len(frames)], dtype=torch.int64), self.leader,
                       group=self.group)
        dist.broadcast(torch.tensor(sizes, dtype=torch.int64), self.leader, group=self.group)
        payload = torch.empty(len(header) + sum(sizes), dtype=torch.uint8)
        payload[: len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        offset = len(header)
        for frame, size in zip(frames, sizes, strict=True):
            if size:
                payload[offset : offset + size] = torch.frombuffer(bytearray(memoryview(frame).cast("B")),
                                                                   dtype=torch.uint8)
            offset += size
        dist.broadcast(payload, self.leader, group=self.group)

    def send_stop(self) -> None:
        dist.broadcast(torch.tensor([STOP, 0, 0], dtype=torch.int64), self.leader, group=self.group)

    def receive(self) -> tuple[dict[str, list[Any]], list[int]] | None:
        """The next micro-batch (columns, versions), or None once the leader stops."""
        head = torch.empty(3, dtype=torch.int64)
        dist.broadcast(head, self.leader, group=self.group)
        kind, header_len, n_frames = (int(x) for x in head.tolist())
        if kind == STOP:
            return None
        if kind != BATCH:
            raise RuntimeError(f"train replica channel: unknown message kind {kind} from TP rank 0")
        sizes = torch.empty(n_frames, dtype=torch.int64)
        dist.broadcast(sizes, self.leader, group=self.group)
        payload = torch.empty(header_len + int(sizes.sum()), dtype=torch.uint8)
        dist.broadcast(payload, self.leader, group=self.group)
        header = _decoder.decode(payload[:header_len].numpy().tobytes())
        frames, offset = [], header_len
        for size in sizes.tolist():
            frames.append(memoryview(payload[offset : offset + size].numpy()))
            offset += size
        return decode_columns(header.columns, frames, header.n, exact=True), header.versions
