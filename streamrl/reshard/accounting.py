"""Memory and traffic accounting of a reshard: peak extra bytes, bytes moved, time per bucket.

"Extra" memory is what the reshard allocates on top of the training shards and the inference
weights it fills: the gathered bucket and, when sending to generation workers, one staging
chunk (``ReshardConfig.staging_bytes``) through which every slice is streamed; a generation
worker receiving holds only its staging chunk. :class:`MemoryTracker` counts every such allocation
when it is made and when it is released, so the peak it reports is the peak of live transient
bytes, per rank. On CUDA/NPU the resharder also reads the allocator's own peak
(``device_peak_extra_bytes``) as a cross-check.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class MemoryTracker:
    """Live and peak transient bytes; allocate/release must pair."""

    def __init__(self) -> None:
        self.live_bytes = 0
        self.peak_bytes = 0

    def allocate(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def release(self, nbytes: int) -> None:
        if nbytes > self.live_bytes:
            raise RuntimeError(f"releasing {nbytes} bytes but only {self.live_bytes} are live")
        self.live_bytes -= nbytes


@dataclass
class BucketStats:
    """One bucket on one rank. Bytes are bytes; times are seconds of wall clock."""

    index: int
    num_params: int
    gathered_bytes: int = 0  # size of the all-gathered bucket buffer (R x local shard bytes)
    staging_bytes: int = 0  # the send/receive staging chunk's buffer (disaggregated only)
    peak_extra_bytes: int = 0  # live transient bytes at this bucket's peak
    received_bytes: int = 0  # bytes that arrived from other ranks (all-gather or point-to-point)
    sent_bytes: int = 0  # bytes this rank sent point-to-point to generation workers
    sliced_bytes: int = 0  # bytes copied into inference weights on this rank
    gather_s: float = 0.0
    slice_s: float = 0.0
    transfer_s: float = 0.0  # point-to-point send/receive time (disaggregated)


@dataclass
class ReshardReport:
    """A whole reshard on one rank."""

    version: int
    role: str  # "colocated", "sender" or "receiver"
    bucket_bytes_limit: int | None  # configured cap on gathered bytes per bucket (None: whole model)
    buckets: list[BucketStats] = field(default_factory=list)
    peak_extra_bytes: int = 0
    total_s: float = 0.0
    device_peak_extra_bytes: int | None = None  # allocator-measured on CUDA/NPU, None on CPU

    @property
    def largest_bucket_bytes(self) -> int:
        return max((b.gathered_bytes for b in self.buckets), default=0)

    @property
    def bytes_moved(self) -> int:
        """Bytes that crossed a process boundary into or out of this rank."""
        return sum(b.received_bytes + b.sent_bytes for b in self.buckets)

    @property
    def sent_bytes(self) -> int:
        return sum(b.sent_bytes for b in self.buckets)

    @property
    def received_bytes(self) -> int:
        return sum(b.received_bytes for b in self.buckets)

    @property
    def sliced_bytes(self) -> int:
        return sum(b.sliced_bytes for b in self.buckets)

    def summary(self) -> dict[str, float | int | str | None]:
        return {
            "version": self.version,
            "role": self.role,
            "buckets": len(self.buckets),
            "bucket_bytes_limit": self.bucket_bytes_limit,
            "largest_bucket_bytes": self.largest_bucket_bytes,
            "peak_extra_bytes": self.peak_extra_bytes,
            "device_peak_extra_bytes": self.device_peak_extra_bytes,
            "bytes_moved": self.bytes_moved,
            "sent_bytes": self.sent_bytes,
            "received_bytes": self.received_bytes,
            "sliced_bytes": self.sliced_bytes,
            "total_s": self.total_s,
        }


@dataclass(frozen=True)
class SwapReport:
    """One direction of a training-state swap on one rank."""

    direction: str  # "to_host" or "to_device"
    tensors: int
    bytes: int
    seconds: float
    pinned: bool  # host buffers are page-locked (CUDA/NPU), so the copies are truly asynchronous
