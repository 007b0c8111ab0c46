"""The dock's metadata controller: who may read which sample, never the data itself.

State per live sample: its group, policy version, length, a bitmask of the columns that are
ready, and per consumer one of PENDING / CLAIMED / DONE. Per consumer a *view* (the columns it
reads and whether it claims whole groups: declared at start by the launcher, which knows the
pipeline, or else fixed by the consumer's first claim) keeps a FIFO of samples
(or groups) that are ready and pending for it. A column becoming ready appends to the views it
completes; a claim pops from the front. So a claim costs O(samples claimed), never O(capacity).

Leases: claimed samples belong to a lease of the claiming client. Every message from a client
(heartbeats included) renews all its leases; a client silent for longer than its lease TTL
(killed, hung, partitioned) loses them, and their samples go back to the front of the pool.
A sample is freed (and the warehouse told to drop it) once every registered consumer is DONE.

The socket loop is synchronous pyzmq on a ROUTER: it is one process's only job, and a plain loop
has less per-message overhead than an event loop.
"""

from __future__ import annotations

import argparse
import gc
import heapq
import hmac
import itertools
import logging
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from streamrl import wire
from streamrl.curve import CurveAllowList, RunKeys, secure_server
from streamrl.dock import protocol as p
from streamrl.dock.limits import DockLimits, secret_from_env
from streamrl.dock.watch import ParentWatch

log = logging.getLogger("streamrl.dock.controller")

PENDING, CLAIMED, DONE = 0, 1, 2


class ProtocolViolation(Exception):
    """A request that is well-formed but not allowed; answered with an ErrorReply, never fatal."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class _Sample:
    __slots__ = ("group", "group_size", "group_start", "index", "length", "n_done", "ready", "state", "version")

    def __init__(self, index: int, group: int, group_start: int, group_size: int, n_consumers: int) -> None:
        self.index = index
        self.group = group
        self.group_start = group_start
        self.group_size = group_size
        self.version = 0
        self.length = 0
        self.ready = 0  # bitmask over column ids
        self.state = bytearray(n_consumers)
        self.n_done = 0


@dataclass(frozen=True)
class ConsumerView:
    """What a consumer reads and whether it claims whole groups, declared when the controller starts."""

    reads: list[str]
    whole_groups: bool = False


@dataclass
class _View:
    """A consumer's fixed way of claiming, and its FIFO of claimable samples (or group starts)."""

    consumer: int
    reads_mask: int
    reads: list[str]
    whole_groups: bool
    queue: deque[int] = field(default_factory=deque)
    queued_groups: dict[int, int] = field(default_factory=dict)  # queued group start -> group size
    queued_pending: int = 0  # whole-group views: PENDING members of the queued groups (ready_count in O(1))


@dataclass
class _Lease:
    lease_id: int
    client_id: str
    consumer: int
    indices: set[int]


@dataclass(eq=False)  # identity, not field equality: `in`/remove on the waiting lists stay O(1) per item
class _PendingClaim:
    identity: bytes
    req: p.Claim
    deadline: float


@dataclass(eq=False)
class _PendingReserve:
    identity: bytes
    req: p.Reserve
    deadline: float


class ControllerState:
    """All controller bookkeeping, independent of sockets (unit-testable, deterministic)."""

    def __init__(
        self,
        consumers: list[str],
        capacity: int,
        n_warehouses: int,
        views: Mapping[str, ConsumerView] | None = None,
        block: int = 1,
    ) -> None:
        if not consumers:
            raise ValueError("the dock needs at least one consumer: the stage names that must ack each sample")
        if len(set(consumers)) != len(consumers):
            raise ValueError(f"consumer names must be unique, got {consumers}")
        if capacity < 1:
            raise ValueError(f"capacity (samples in flight) must be >= 1, got {capacity}")
        if not 1 <= block <= p.MAX_BLOCK:
            raise ValueError(f"block (samples per ownership block) must be in [1, {p.MAX_BLOCK}], got {block}")
        self.consumers = list(consumers)
        self.consumer_ids = {c: i for i, c in enumerate(consumers)}
        self.capacity = capacity
        self.n_warehouses = n_warehouses
        self.samples: dict[int, _Sample] = {}
        self.column_bits: dict[str, int] = {}
        self.views: list[_View | None] = [None] * len(consumers)
        # declared views (the launcher knows every stage's reads): fixed now, so no client's claim
        # can pick them; without declarations (tests, benchmarks) a consumer's first claim fixes its view
        self.declared = bool(views)
        if views:
            unknown = sorted(set(views) - set(consumers))
            missing = [c for c in consumers if c not in views]
            if unknown or missing:
                raise ValueError(f"consumer views must be declared for exactly the consumers {consumers}: "
                                 f"undeclared {missing}, not consumers {unknown}")
        self.done_count = [0] * len(consumers)  # samples each consumer acked or dropped, ever
        self.claimed_count = [0] * len(consumers)  # samples each consumer holds under leases now
        # ownership: sample k lives on warehouse (k // block) % n_warehouses (docs §5.1). block 1:
        # one cursor hands out 0, 1, 2, ... (k % W); block > 1: a cursor per warehouse over its own blocks
        self.block = block
        self.next_index = 0  # block 1: the next index to hand out
        self.block_cursor = [w * block for w in range(n_warehouses)] if block > 1 else []
        self.reserved_by_warehouse = [0] * n_warehouses if block > 1 else []
        self.next_round_robin = 0  # block > 1: the warehouse of the next reserve that names none
        self.n_reserved = 0  # samples reserved so far (indices may skip block tails when block > 1)
        self.client_home: dict[str, int] = {}  # client id -> the warehouse on its node (hello.home_warehouse)
        self.next_group = 0
        self.next_lease = itertools.count(1)
        self.leases: dict[int, _Lease] = {}
        self.client_leases: dict[str, set[int]] = {}
        self.input_closed = False
        self.to_free: list[int] = []  # freed indices not yet announced to the warehouses
        self.counters = dict.fromkeys(
            ("reserved", "claims", "samples_claimed", "samples_acked", "samples_freed",
             "samples_released", "dropped_stale", "leases_expired", "errors", "claimed_local", "claimed_remote"),
            0,
        )
        for name, view in (views or {}).items():
            if len(view.reads) > p.MAX_COLUMNS:
                raise ValueError(f"consumer {name!r} reads {len(view.reads)} columns, more than {p.MAX_COLUMNS}")
            cid = self.consumer_ids[name]
            self.views[cid] = _View(cid, self._mask(view.reads), sorted(view.reads), view.whole_groups)

    # ------------------------------------------------------------------ capacity
    @property
    def free_slots(self) -> int:
        return self.capacity - len(self.samples)

    def owner(self, index: int) -> int:
        """The warehouse that stores sample ``index``."""
        return p.owner(index, self.n_warehouses, self.block)

    def check_reserve(self, n: int, group_size: int, warehouse: int | None = None) -> None:
        """Raise ProtocolViolation if a reserve of ``n`` in groups of ``group_size`` can never succeed."""
        if self.input_closed:
            raise ProtocolViolation("input_closed", "the input was closed: no new samples can be reserved")
        if n < 1 or group_size < 1 or n % group_size:
            raise ProtocolViolation(
                "bad_field", f"reserve n={n} must be a positive multiple of group_size={group_size}"
            )
        if n > self.capacity:
            raise ProtocolViolation(
                "bad_field", f"reserve n={n} exceeds the dock capacity {self.capacity}: raise dock.capacity"
            )
        if warehouse is not None and warehouse >= self.n_warehouses:
            raise ProtocolViolation("bad_field", f"reserve warehouse={warehouse} outside [0, {self.n_warehouses}): "
                                    "this dock has that many warehouses")
        if group_size > self.block > 1:
            raise ProtocolViolation(
                "bad_field", f"reserve group_size={group_size} exceeds the dock's ownership block={self.block}: "
                "a group never straddles a block, so group_size must be <= block (controller --block)")

    def reserve(self, n: int, group_size: int, warehouse: int | None = None) -> tuple[list[int], list[int]]:
        """Allocate ``n`` new sample indices in groups of ``group_size``; caller checked capacity.

        block 1: the next ``n`` indices (``warehouse`` is ignored). block > 1: groups inside blocks
        owned by ``warehouse`` (round robin over the warehouses, one per reserve, when None)."""
        self.check_reserve(n, group_size, warehouse)
        indices, groups = [], []
        nc = len(self.consumers)
        if self.block == 1:
            starts: range | list[int] = range(self.next_index, self.next_index + n, group_size)
            self.next_index += n
        else:
            if warehouse is None:
                warehouse = self.next_round_robin
                self.next_round_robin = (warehouse + 1) % self.n_warehouses
            starts = self._block_starts(warehouse, n // group_size, group_size)
            self.reserved_by_warehouse[warehouse] += n
        for start in starts:
            g = self.next_group
            self.next_group += 1
            for i in range(start, start + group_size):
                self.samples[i] = _Sample(i, g, start, group_size, nc)
                indices.append(i)
                groups.append(g)
                for view in self.views:  # a consumer that reads nothing may claim it at once
                    if view is not None and view.reads_mask == 0:
                        self._enqueue(view, self.samples[i], front=False)
        self.n_reserved += n
        self.counters["reserved"] += n
        return indices, groups

    def _block_starts(self, warehouse: int, n_groups: int, group_size: int) -> list[int]:
        """Starts of ``n_groups`` contiguous groups inside the blocks ``warehouse`` owns, from its cursor;
        a group that would cross its block's end starts the warehouse's next block instead."""
        b, nw = self.block, self.n_warehouses
        cur = self.block_cursor[warehouse]
        starts = []
        for _ in range(n_groups):
            if cur % b + group_size > b:
                cur = (cur // b + nw) * b  # the tail of this block stays unused
            starts.append(cur)
            cur += group_size
            if cur % b == 0:
                cur += (nw - 1) * b  # skip the other warehouses' blocks
        self.block_cursor[warehouse] = cur
        return starts

    # ------------------------------------------------------------------ readiness
    def _bit(self, column: str) -> int:
        bit = self.column_bits.get(column)
        if bit is None:
            if len(self.column_bits) >= p.MAX_COLUMNS:
                # each sample's readiness is a bitmask over every column name ever seen: bounded
                raise ProtocolViolation("too_many_columns", f"column {column!r} would be the dock's "
                                        f"{p.MAX_COLUMNS + 1}th distinct column name (limit MAX_COLUMNS)")
            bit = 1 << len(self.column_bits)
            self.column_bits[column] = bit
        return bit

    def _mask(self, columns: list[str]) -> int:
        mask = 0
        for c in columns:
            mask |= self._bit(c)
        return mask

    def columns_ready(
        self,
        indices: list[int],
        columns: list[str],
        versions: list[int] | None,
        lengths: list[int] | None,
    ) -> tuple[set[int], list[int]]:
        """Mark columns ready. Returns (consumers with new claimable samples, unknown indices)."""
        mask = self._mask(columns)
        touched: set[int] = set()
        unknown: list[int] = []
        for k, i in enumerate(indices):
            s = self.samples.get(i)
            if s is None:
                unknown.append(i)  # freed already, or never reserved: the warehouse must drop it
                continue
            if versions is not None:
                s.version = versions[k]
            if lengths is not None:
                s.length = lengths[k]
            old = s.ready
            s.ready = old | mask
            if s.ready == old:
                continue
            for view in self.views:
                if view is None or s.state[view.consumer] != PENDING:
                    continue
                rm = view.reads_mask
                if (old & rm) != rm and (s.ready & rm) == rm and self._enqueue(view, s, front=False):
                    touched.add(view.consumer)
        return touched, unknown

    def _enqueue(self, view: _View, s: _Sample, front: bool) -> bool:
        if not view.whole_groups:
            (view.queue.appendleft if front else view.queue.append)(s.index)
            return True
        g = s.group_start
        if g in view.queued_groups:
            return False
        pending = self._group_claimable(view, g, s.group_size)
        if not pending:
            return False
        view.queued_groups[g] = s.group_size
        view.queued_pending += pending
        (view.queue.appendleft if front else view.queue.append)(g)
        return True

    def _group_claimable(self, view: _View, start: int, size: int) -> int:
        """PENDING members if every member is DONE for this consumer or (PENDING and ready), else 0."""
        pending = 0
        rm = view.reads_mask
        for i in range(start, start + size):
            s = self.samples.get(i)
            if s is None:
                continue  # freed members were DONE for everyone
            st = s.state[view.consumer]
            if st == CLAIMED or (st == PENDING and (s.ready & rm) != rm):
                return 0
            pending += st == PENDING
        return pending

    def _view_for(self, req: p.Claim) -> _View:
        cid = self.consumer_ids.get(req.consumer)
        if cid is None:
            raise ProtocolViolation(
                "unknown_consumer", f"consumer {req.consumer!r} is not registered; known: {self.consumers}"
            )
        view = self.views[cid]
        if view is None:
            mask = self._mask(req.reads)
            view = _View(cid, mask, sorted(req.reads), req.whole_groups)
            self.views[cid] = view
            # one O(live samples) scan when the consumer first shows up; incremental afterwards
            for s in self.samples.values():
                if s.state[cid] == PENDING and (s.ready & mask) == mask:
                    self._enqueue(view, s, front=False)
        elif view.whole_groups != req.whole_groups or view.reads != sorted(req.reads):
            how = "is declared (by the launcher, from the pipeline) with" if self.declared else "already claims"
            raise ProtocolViolation(
                "bad_field",
                f"consumer {req.consumer!r} {how} reads={view.reads} whole_groups={view.whole_groups}; "
                f"this claim has reads={sorted(req.reads)} whole_groups={req.whole_groups}. A consumer's reads "
                "are fixed: claim with exactly those.",
            )
        return view

    def ready_count(self, view: _View) -> int:
        return view.queued_pending if view.whole_groups else len(view.queue)

    def outstanding(self, consumer: int) -> int:
        """Samples reserved so far that this consumer has neither done nor currently claimed."""
        return self.n_reserved - self.done_count[consumer] - self.claimed_count[consumer]

    def at_end(self, consumer: int) -> bool:
        return self.input_closed and self.done_count[consumer] == self.n_reserved

    # ------------------------------------------------------------------ claims and leases
    def validate_claim(self, req: p.Claim) -> _View:
        if req.n < 1 or req.min_n < 1 or req.min_n > req.n:
            raise ProtocolViolation("bad_field", f"claim needs 1 <= min_n <= n, got n={req.n} min_n={req.min_n}")
        return self._view_for(req)

    def try_claim(self, req: p.Claim, view: _View, force: bool) -> p.Claimed | None:
        """Claim now if ``min_n`` samples are claimable (or ``force`` and any are); else None."""
        dropped = self._drop_stale(view, req.min_version) if req.min_version is not None else 0
        available = self.ready_count(view)
        # fewer than min_n are fine when no more can ever come (input closed, all others delivered)
        last_ones = self.input_closed and available == self.outstanding(view.consumer)
        if available < req.min_n and not ((force or last_ones) and available > 0):
            if dropped or self.at_end(view.consumer):
                return p.Claimed(req.req_id, 0, [], dropped, self.at_end(view.consumer))
            return None
        picked = self._pop(view, req.n, req.balance_by_length)
        lease = _Lease(next(self.next_lease), req.client_id, view.consumer, set(picked))
        self.leases[lease.lease_id] = lease
        self.client_leases.setdefault(req.client_id, set()).add(lease.lease_id)
        infos = []
        for i in picked:
            s = self.samples[i]
            s.state[view.consumer] = CLAIMED
            self.claimed_count[view.consumer] += 1
            infos.append(p.SampleInfo(i, s.group, s.group_size, s.version, s.length))
        home = self.client_home.get(req.client_id)
        if home is not None:  # locality statistics, only for clients that said where they run
            local = sum(1 for i in picked if self.owner(i) == home)
            self.counters["claimed_local"] += local
            self.counters["claimed_remote"] += len(picked) - local
        self.counters["claims"] += 1
        self.counters["samples_claimed"] += len(picked)
        return p.Claimed(req.req_id, lease.lease_id, infos, dropped, False)

    def _pop(self, view: _View, n: int, balance: bool) -> list[int]:
        if not view.whole_groups:
            if not balance or len(view.queue) <= n:
                return [view.queue.popleft() for _ in range(min(n, len(view.queue)))]
            # length balancing over a window of 4n: the n samples of closest lengths, so a
            # micro-batch pads little; the others go back to the front in their old order
            window = [view.queue.popleft() for _ in range(min(4 * n, len(view.queue)))]
            by_len = sorted(window, key=lambda i: self.samples[i].length)
            spread = [
                self.samples[by_len[k + n - 1]].length - self.samples[by_len[k]].length
                for k in range(len(by_len) - n + 1)
            ]
            k = min(range(len(spread)), key=spread.__getitem__)
            chosen = set(by_len[k : k + n])
            view.queue.extendleft(reversed([i for i in window if i not in chosen]))
            return [i for i in window if i in chosen]
        picked: list[int] = []
        while view.queue:
            start = view.queue[0]
            members = [
                i
                for i in range(start, start + view.queued_groups[start])
                if i in self.samples and self.samples[i].state[view.consumer] == PENDING
            ]
            if picked and len(picked) + len(members) > n:
                break  # whole groups only: the next group would overflow the micro-batch
            view.queue.popleft()
            del view.queued_groups[start]
            view.queued_pending -= len(members)
            picked.extend(members)
            if len(picked) >= n:
                break
        return picked

    def _drop_stale(self, view: _View, min_version: int) -> int:
        """Samples too old for this consumer are DONE for it without being delivered.

        Versions only grow along a queue in a pipeline (the generator tags increasing
        versions), so stale samples sit at the front: pop them until the head is fresh. That
        costs O(dropped), not O(queue); a stale sample behind a fresh one is dropped when it
        reaches the front.
        """
        dropped = 0
        while view.queue:
            head = view.queue[0]
            size = view.queued_groups.get(head, 1) if view.whole_groups else 1
            members = [self.samples.get(i) for i in range(head, head + size)]
            versions = [m.version for m in members if m is not None]
            if not versions or min(versions) >= min_version:
                break
            view.queue.popleft()
            if view.whole_groups:
                del view.queued_groups[head]
            for m in members:
                if m is not None and m.state[view.consumer] == PENDING:
                    if view.whole_groups:
                        view.queued_pending -= 1
                    self._mark_done(m, view.consumer)
                    dropped += 1
        self.counters["dropped_stale"] += dropped
        return dropped

    def _mark_done(self, s: _Sample, consumer: int) -> None:
        s.state[consumer] = DONE
        s.n_done += 1
        self.done_count[consumer] += 1
        if s.n_done == len(self.consumers):
            del self.samples[s.index]
            self.to_free.append(s.index)
            self.counters["samples_freed"] += 1

    def ack(self, client_id: str, lease_id: int, indices: list[int] | None) -> int:
        """Mark (some of) a lease's samples DONE; returns the lease's consumer id."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.client_id != client_id:
            raise ProtocolViolation(
                "unknown_lease",
                f"lease {lease_id} is not held by client {client_id!r} (expired after the lease TTL, "
                "already acked, or released)",
            )
        targets = list(lease.indices) if indices is None else list(dict.fromkeys(indices))  # no duplicates
        stray = [i for i in targets if i not in lease.indices]
        if stray:
            raise ProtocolViolation("bad_field", f"indices {stray[:8]} are not in lease {lease_id}")
        for i in targets:
            lease.indices.discard(i)
            self.claimed_count[lease.consumer] -= 1
            self._mark_done(self.samples[i], lease.consumer)
        self.counters["samples_acked"] += len(targets)
        if not lease.indices:
            self._drop_lease(lease)
        return lease.consumer

    def release(self, client_id: str, lease_id: int) -> int:
        """Give a lease's unacked samples back (front of the queue). Returns the consumer id."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.client_id != client_id:
            raise ProtocolViolation("unknown_lease", f"lease {lease_id} is not held by client {client_id!r}")
        self._return_lease(lease)
        return lease.consumer

    def _return_lease(self, lease: _Lease) -> None:
        self._drop_lease(lease)
        view = self.views[lease.consumer]
        assert view is not None
        self.claimed_count[lease.consumer] -= len(lease.indices)
        for i in sorted(lease.indices, reverse=True):
            s = self.samples[i]
            s.state[lease.consumer] = PENDING
            if (s.ready & view.reads_mask) == view.reads_mask:
                self._enqueue(view, s, front=True)
        self.counters["samples_released"] += len(lease.indices)

    def _drop_lease(self, lease: _Lease) -> None:
        self.leases.pop(lease.lease_id, None)
        held = self.client_leases.get(lease.client_id)
        if held is not None:
            held.discard(lease.lease_id)
            if not held:
                del self.client_leases[lease.client_id]

    def expire_client(self, client_id: str) -> set[int]:
        """The client went silent: every lease it holds goes back to the pool."""
        touched = set()
        for lease_id in list(self.client_leases.get(client_id, ())):
            lease = self.leases[lease_id]
            self._return_lease(lease)
            touched.add(lease.consumer)
            self.counters["leases_expired"] += 1
        return touched

    def take_freed(self) -> list[int]:
        freed, self.to_free = self.to_free, []
        return freed

    def statistics(self) -> dict[str, Any]:
        claimed = sum(len(lease.indices) for lease in self.leases.values())
        per_consumer = {}
        for cid, name in enumerate(self.consumers):
            view = self.views[cid]
            per_consumer[name] = {
                "ready": self.ready_count(view) if view else 0,
                "claimed": self.claimed_count[cid],
                "done": self.done_count[cid],
                "reads": view.reads if view else None,
            }
        return {
            "capacity": self.capacity,
            "in_flight": len(self.samples),
            "claimed": claimed,
            "leases": len(self.leases),
            "input_closed": self.input_closed,
            "reserved_total": self.n_reserved,
            "block": self.block,
            "reserved_per_warehouse": self._reserved_per_warehouse(),
            "columns": sorted(self.column_bits),
            "consumers": per_consumer,
            **self.counters,
        }


    def _reserved_per_warehouse(self) -> list[int]:
        if self.block > 1:
            return list(self.reserved_by_warehouse)
        q, r = divmod(self.next_index, self.n_warehouses)  # block 1: indices 0 .. next_index - 1, k % W
        return [q + (w < r) for w in range(self.n_warehouses)]


DEFAULT_TTL_S = 10.0  # lease TTL of a client that never sent hello
# Idle clients are forgotten only when the client limit is reached, at most this often (a scan is
# O(clients): a flood of new ids must not make every message pay for one). Not periodically:
# a forgotten client loses the TTL its hello set, so a worker that was idle for a while would
# come back with the 10 s default and could lose a lease it holds through a long step.
FORGET_AT_MOST_EVERY_S = 0.1


class ControllerServer:
    """Serves :class:`ControllerState` on a ROUTER socket. One process, one thread.

    Every message goes through :meth:`handle`: frame count, then the socket's one typed decoder
    (:func:`protocol.decode_request`: types, bounds, UTF-8, nesting), then :meth:`_dispatch`, whose
    refusals are :class:`ProtocolViolation` answered with an ``error`` reply. Per-peer state is
    bounded: at most ``limits.max_clients`` client ids (when that is reached, those holding no
    lease and silent past their TTL are forgotten) and ``limits.max_parked`` claims/reserves held
    open; answered long-polls leave the deadline heap once they dominate it.
    """

    def __init__(
        self,
        bind: str,
        consumers: list[str],
        capacity: int,
        n_warehouses: int,
        *,
        secret: str,
        limits: DockLimits | None = None,
        views: Mapping[str, ConsumerView] | None = None,
        context: zmq.Context | None = None,
        hwm: int = 100_000,
        curve: RunKeys | None = None,
        block: int = 1,
    ) -> None:
        if not secret:
            raise ValueError("the controller needs a non-empty warehouse secret (the launcher generates one per run)")
        if not 1 <= n_warehouses <= 65_536:
            raise ValueError(f"n_warehouses must be in [1, 65536], got {n_warehouses}")
        self.state = ControllerState(consumers, capacity, n_warehouses, views, block)
        self.limits = limits or DockLimits()
        self._secret = secret.encode()
        self.ctx = context or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        # finite high-water marks: a flood of requests queues in bounded memory, then TCP pushes back
        self.sock.setsockopt(zmq.RCVHWM, hwm)
        self.sock.setsockopt(zmq.SNDHWM, hwm)
        # only headers come here: a longer frame disconnects its sender inside libzmq, unallocated
        self.sock.setsockopt(zmq.MAXMSGSIZE, self.limits.max_header_bytes)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a vanished peer raises, never blocks
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.BACKLOG, 1024)  # hundreds of workers connect at once at start-up
        # CURVE (keys given: a run beyond loopback): only the run's client key pair completes a handshake
        self.zap: CurveAllowList | None = secure_server(self.sock, curve)
        self.sock.bind(bind)
        self.endpoint: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.warehouses: dict[int, tuple[bytes, str]] = {}  # warehouse id -> (routing id, endpoint)
        self.warehouse_ids: dict[bytes, int] = {}  # routing id of a registered warehouse -> its id
        self.pending_hellos: dict[str, tuple[bytes, p.Hello]] = {}  # by client id: a repeated hello replaces
        self.pending_claims: dict[int, list[_PendingClaim]] = {}
        self.pending_reserves: deque[_PendingReserve] = deque()
        self.deadlines: list[tuple[float, int, Any]] = []  # heap of (deadline, seq, pending item)
        self.stale_deadlines = 0  # heap entries of items answered before their deadline
        self.seq = itertools.count()
        self.client_ttl: dict[str, float] = {}
        self.client_seen: dict[str, float] = {}
        self.refused = dict.fromkeys(("warehouse_hello", "columns_ready", "clients"), 0)
        self._stop = False
        self.parent = ParentWatch()  # set .pid to stop once the launcher is gone (no orphans)
        self._next_expiry_scan = 0.0
        self._next_forget = 0.0
        self._warn = wire.SparseLog(log).warning  # a peer's garbage in a loop must not fill the disk

    # ------------------------------------------------------------------ replies
    def _send(self, identity: bytes, msg: msgspec.Struct) -> None:
        try:
            self.sock.send_multipart([identity, p.encoder.encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone or its queue full: it will time out and retry
            self._warn("reply", "dropping reply %s to %r: %s", type(msg).__name__, identity, exc)

    def _error(self, identity: bytes, req_id: int, code: str, message: str) -> None:
        self.state.counters["errors"] += 1
        self._send(identity, p.ErrorReply(req_id, code, message))

    # ------------------------------------------------------------------ main loop
    def stop(self) -> None:
        self._stop = True

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop:
            if self.parent.gone():
                break
            timeout_ms = self._poll_timeout_ms()
            events = dict(poller.poll(timeout_ms))
            if self.sock in events:
                # drain what is queued before doing timer work: batches messages under load
                for _ in range(1000):
                    try:
                        frames = self.sock.recv_multipart(flags=zmq.NOBLOCK, copy=True)
                    except zmq.Again:
                        break
                    self.handle(frames)
            self._on_timers()
            self._flush_frees()
        self.sock.close(linger=0)

    def _poll_timeout_ms(self) -> int:
        now = time.monotonic()
        nxt = now + 0.1  # expiry scans at least every 100 ms
        if self.deadlines:
            nxt = min(nxt, self.deadlines[0][0])  # deadlines are finite: timeouts are bounded on the wire
        return max(0, int((nxt - now) * 1000) + 1)

    def handle(self, frames: list[bytes]) -> None:
        """One message: every request goes through this decode-and-validate path."""
        if len(frames) < 2:
            self._warn("frames", "dropping message with %d frames (need routing id + header)", len(frames))
            return
        identity, header = frames[0], frames[1]
        if len(frames) > 2:
            rid = p.salvage_req_id(header)
            if rid is not None:
                self._error(identity, rid, "bad_frames", "controller messages carry no tensor frames: send the "
                            "header alone")
            return
        msg, error = p.decode_request(p.controller_request_decoder, header)
        if msg is None:
            self._warn("decode", "undecodable controller message from %r", identity)
            if error is not None:
                self._error(identity, error.req_id, error.code, error.message)
            return
        try:
            self._dispatch(identity, msg)
        except ProtocolViolation as exc:
            self._error(identity, getattr(msg, "req_id", -1), exc.code, str(exc))
        except Exception as exc:  # a bug must not take the controller down for everyone
            log.exception("internal error handling %s", type(msg).__name__)
            self._error(identity, getattr(msg, "req_id", -1), "internal", f"{type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ clients
    def _touch(self, client_id: str) -> None:
        """Client ``client_id`` is alive (renews its leases); a new one counts against max_clients."""
        seen = self.client_seen
        if client_id not in seen and len(seen) >= self.limits.max_clients:
            now = time.monotonic()
            if now >= self._next_forget:
                self._forget_idle(now)
            if len(seen) >= self.limits.max_clients:
                self.refused["clients"] += 1
                raise ProtocolViolation(
                    "too_many_clients",
                    f"the controller already keeps state for {len(seen)} clients, its limit (resources.dock."
                    f"max_clients, controller flag --max-clients): client {client_id!r} refused. Raise the "
                    "limit, or reuse client ids; a client holding no lease is forgotten once silent for its "
                    "lease TTL.",
                )
        seen[client_id] = time.monotonic()

    def _forget_idle(self, now: float) -> None:
        """Drop the state of clients that hold no lease and were silent longer than their TTL."""
        self._next_forget = now + FORGET_AT_MOST_EVERY_S
        holding = self.state.client_leases
        ttl = self.client_ttl
        idle = [cid for cid, seen in self.client_seen.items()
                if cid not in holding and now - seen > ttl.get(cid, DEFAULT_TTL_S)]
        for cid in idle:
            del self.client_seen[cid]
            ttl.pop(cid, None)
            self.pending_hellos.pop(cid, None)
            self.state.client_home.pop(cid, None)

    def _granted(self, client_id: str) -> None:
        """A parked claim was granted: its lease's TTL runs from now, even if the (possibly idle)
        client was forgotten meanwhile; otherwise the lease would never expire."""
        self.client_seen[client_id] = time.monotonic()

    def _park(self, item: _PendingClaim | _PendingReserve) -> None:
        parked = len(self.pending_reserves) + sum(len(v) for v in self.pending_claims.values())
        if parked >= self.limits.max_parked:
            raise ProtocolViolation(
                "busy", f"the controller already holds {parked} claims/reserves open, its limit (resources.dock."
                "max_parked, controller flag --max-parked): retry later with a shorter timeout_s, or raise it")
        heapq.heappush(self.deadlines, (item.deadline, next(self.seq), item))

    def _answered(self, item: _PendingClaim | _PendingReserve) -> None:
        """``item`` was answered before its deadline: its heap entry is stale. Rebuild the heap once
        stale entries dominate, so answered long-polls do not pile up until their deadlines."""
        item.deadline = -1.0
        self.stale_deadlines += 1
        if self.stale_deadlines > 1024 and 2 * self.stale_deadlines > len(self.deadlines):
            self.deadlines = [e for e in self.deadlines if e[2].deadline >= 0]
            heapq.heapify(self.deadlines)
            self.stale_deadlines = 0

    # ------------------------------------------------------------------ dispatch
    def _dispatch(self, identity: bytes, msg: p.ControllerRequest) -> None:
        st = self.state
        match msg:
            case p.Heartbeat(client_id=cid):
                if cid in self.client_seen:  # no reply, and an unknown client has nothing to renew
                    self.client_seen[cid] = time.monotonic()
            case p.Claim():
                self._touch(msg.client_id)
                view = st.validate_claim(msg)
                reply = st.try_claim(msg, view, force=False)
                if reply is not None:
                    self._send(identity, reply)
                elif not msg.timeout_s:
                    self._send(identity, p.Claimed(msg.req_id, 0, [], 0, False))
                else:
                    item = _PendingClaim(identity, msg, time.monotonic() + msg.timeout_s)
                    self._park(item)
                    self.pending_claims.setdefault(view.consumer, []).append(item)
            case p.Ack(client_id=cid, lease_id=lid, indices=idx):
                self._touch(cid)
                consumer = st.ack(cid, lid, idx)
                self._send(identity, p.Ok(msg.req_id))
                self._serve_reserves()
                self._serve_claims(consumer)  # this ack may be the one that ends the stream
            case p.ColumnsReady(warehouse_id=wid, indices=idx, columns=cols, versions=vers, lengths=lens):
                if self.warehouse_ids.get(identity) != wid:
                    # only the registered warehouse may say its data is stored: anyone else could
                    # make consumers claim samples whose columns exist nowhere
                    self.refused["columns_ready"] += 1
                    raise ProtocolViolation("unauthorized", f"columns_ready is accepted only from the connection "
                                            f"that registered as warehouse {wid} (warehouse_hello)")
                n = len(idx)
                if (vers is not None and len(vers) != n) or (lens is not None and len(lens) != n):
                    raise ProtocolViolation("bad_field", f"columns_ready: versions/lengths need {n} entries")
                touched, unknown = st.columns_ready(idx, cols, vers, lens)
                if unknown:
                    self._send(identity, p.Free(unknown))  # data for dead indices: drop it
                for consumer in touched:
                    self._serve_claims(consumer)
            case p.Reserve():
                self._touch(msg.client_id)
                self._reserve(identity, msg)
            case p.Release(client_id=cid, lease_id=lid):
                self._touch(cid)
                consumer = st.release(cid, lid)
                self._send(identity, p.Ok(msg.req_id))
                self._serve_claims(consumer)
            case p.Hello(client_id=cid):
                if msg.protocol != p.PROTOCOL_VERSION:
                    raise ProtocolViolation(
                        "protocol", f"client speaks protocol {msg.protocol}, controller {p.PROTOCOL_VERSION}: "
                        "upgrade the older side"
                    )
                home = msg.home_warehouse
                if home is not None and home >= st.n_warehouses:
                    raise ProtocolViolation("bad_field", f"hello home_warehouse={home} outside [0, "
                                            f"{st.n_warehouses}): this dock has that many warehouses")
                self._touch(cid)
                self.client_ttl[cid] = msg.lease_ttl_s  # bounds checked by the decoder (Ttl)
                if home is None:
                    st.client_home.pop(cid, None)
                else:
                    st.client_home[cid] = home
                self.pending_hellos[cid] = (identity, msg)
                self._answer_hellos()
            case p.WarehouseHello():
                self._register_warehouse(identity, msg)
            case p.CloseInput(client_id=cid):
                self._touch(cid)
                st.input_closed = True
                self._send(identity, p.Ok(msg.req_id))
                for consumer in range(len(st.consumers)):
                    self._serve_claims(consumer)
            case p.StatsRequest(req_id=rid):
                stats = st.statistics()
                stats["pending_claims"] = sum(len(v) for v in self.pending_claims.values())
                stats["pending_reserves"] = len(self.pending_reserves)
                stats["clients"] = len(self.client_seen)
                stats["refused"] = dict(self.refused)
                stats["warehouses_registered"] = len(self.warehouses)
                if self.zap is not None:  # CURVE handshakes admitted / refused by the allow-list
                    stats["curve"] = {"accepted": self.zap.accepted, "refused": self.zap.refused}
                self._send(identity, p.Stats(rid, stats))

    def _register_warehouse(self, identity: bytes, msg: p.WarehouseHello) -> None:
        wid = msg.warehouse_id
        # the secret first: a peer without it learns nothing else about the dock
        if not hmac.compare_digest(msg.secret.encode(), self._secret):
            self.refused["warehouse_hello"] += 1
            raise ProtocolViolation("unauthorized", "warehouse_hello with a wrong secret: start warehouses with "
                                    "the run's secret in STREAMRL_DOCK_SECRET (LocalDock and ThreadDock do)")
        if msg.protocol != p.PROTOCOL_VERSION:
            raise ProtocolViolation("protocol", f"warehouse speaks protocol {msg.protocol}, controller "
                                    f"{p.PROTOCOL_VERSION}: run both from the same streamrl")
        if msg.block != self.state.block:
            raise ProtocolViolation("bad_field", f"warehouse started with block={msg.block}, controller with "
                                    f"block={self.state.block}: start both with the same --block")
        if wid >= self.state.n_warehouses:
            raise ProtocolViolation("bad_field", f"warehouse_id {wid} outside [0, {self.state.n_warehouses}): this "
                                    "dock was started with that many warehouses")
        known = self.warehouses.get(wid)
        other = self.warehouse_ids.get(identity)
        if (known is not None and known[0] != identity) or (other is not None and other != wid):
            self.refused["warehouse_hello"] += 1
            raise ProtocolViolation(
                "already_registered",
                f"warehouse {wid} is already registered from another connection (or this connection is warehouse "
                f"{other}): a warehouse id is taken once per run",
            )
        self.warehouses[wid] = (identity, msg.endpoint)
        self.warehouse_ids[identity] = wid
        self._send(identity, p.Ok(msg.req_id))
        self._answer_hellos()

    def _answer_hellos(self) -> None:
        st = self.state
        if len(self.warehouses) < st.n_warehouses:
            return  # clients wait until every warehouse has registered
        eps = [self.warehouses[w][1] for w in range(st.n_warehouses)]
        for identity, hello in self.pending_hellos.values():
            self._send(identity, p.HelloReply(hello.req_id, p.PROTOCOL_VERSION, eps, st.consumers, st.capacity,
                                              st.block))
        self.pending_hellos.clear()

    def _reserve(self, identity: bytes, msg: p.Reserve) -> None:
        st = self.state
        st.check_reserve(msg.n, msg.group_size, msg.warehouse)
        if not self.pending_reserves and st.free_slots >= msg.n:
            indices, groups = st.reserve(msg.n, msg.group_size, msg.warehouse)
            self._send(identity, p.Reserved(msg.req_id, indices, groups))
            return
        if msg.timeout_s is not None and msg.timeout_s <= 0:
            self._error(identity, msg.req_id, "full", f"dock full: {st.free_slots} free of {st.capacity}")
            return
        # backpressure: the producer waits, FIFO, until consumers free enough samples
        deadline = time.monotonic() + (msg.timeout_s if msg.timeout_s is not None else 1e9)
        item = _PendingReserve(identity, msg, deadline)
        self._park(item)
        self.pending_reserves.append(item)

    def _serve_reserves(self) -> None:
        st = self.state
        while self.pending_reserves and st.free_slots >= self.pending_reserves[0].req.n:
            item = self.pending_reserves.popleft()
            self._answered(item)
            try:
                indices, groups = st.reserve(item.req.n, item.req.group_size, item.req.warehouse)
            except ProtocolViolation as exc:
                self._error(item.identity, item.req.req_id, exc.code, str(exc))
                continue
            self._send(item.identity, p.Reserved(item.req.req_id, indices, groups))

    def _serve_claims(self, consumer: int) -> None:
        waiting = self.pending_claims.get(consumer)
        view = self.state.views[consumer]
        while waiting and view is not None:
            item = waiting[0]
            reply = self.state.try_claim(item.req, view, force=False)
            if reply is None:
                return
            waiting.pop(0)
            self._answered(item)
            if reply.lease_id:
                self._granted(item.req.client_id)
            self._send(item.identity, reply)

    def _on_timers(self) -> None:
        now = time.monotonic()
        while self.deadlines and self.deadlines[0][0] <= now:
            _, _, item = heapq.heappop(self.deadlines)
            if item.deadline < 0:
                self.stale_deadlines = max(0, self.stale_deadlines - 1)
                continue
            if isinstance(item, _PendingClaim):
                cid = self.state.consumer_ids[item.req.consumer]
                waiting = self.pending_claims.get(cid, [])
                if item in waiting:
                    waiting.remove(item)
                view = self.state.views[cid]
                assert view is not None
                reply = self.state.try_claim(item.req, view, force=item.req.partial_at_timeout)
                if reply is not None and reply.lease_id:
                    self._granted(item.req.client_id)
                end = self.state.at_end(view.consumer)
                self._send(item.identity, reply or p.Claimed(item.req.req_id, 0, [], 0, end))
            else:
                if item in self.pending_reserves:
                    self.pending_reserves.remove(item)
                st = self.state
                self._error(item.identity, item.req.req_id, "timeout",
                            f"dock still full after {item.req.timeout_s} s ({st.free_slots} free of {st.capacity})")
        if now >= self._next_expiry_scan:
            self._next_expiry_scan = now + 0.05
            for cid in list(self.state.client_leases):
                ttl = self.client_ttl.get(cid, DEFAULT_TTL_S)
                if now - self.client_seen.get(cid, now) > ttl:
                    log.warning("client %s silent for > %.2f s: its leases go back to the pool", cid, ttl)
                    for consumer in self.state.expire_client(cid):
                        self._serve_claims(consumer)

    def _flush_frees(self) -> None:
        freed = self.state.take_freed()
        if not freed:
            return
        by_wh: dict[int, list[int]] = {}
        owner = self.state.owner
        for i in freed:
            by_wh.setdefault(owner(i), []).append(i)
        for wid, idx in by_wh.items():
            if wid in self.warehouses:
                self._send(self.warehouses[wid][0], p.Free(idx))
        for consumer in range(len(self.state.consumers)):
            if self.pending_claims.get(consumer):
                self._serve_claims(consumer)  # frees can complete the end-of-stream condition
        self._serve_reserves()


def parse_views(text: str) -> dict[str, ConsumerView]:
    """``--views`` JSON: ``{"consumer": {"reads": [...], "whole_groups": false}, ...}``."""
    try:
        raw = msgspec.json.decode(text, type=dict[str, ConsumerView])
    except msgspec.DecodeError as exc:
        raise ValueError(f"--views must be JSON {{consumer: {{reads: [...], whole_groups: bool}}}}: {exc}") from None
    return raw


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m streamrl.dock.controller", description=__doc__.splitlines()[0])
    ap.add_argument("--bind", required=True, help="tcp://127.0.0.1:0 (port from the OS) or ipc:///path")
    ap.add_argument("--consumers", required=True, help="comma-separated stage names that must ack each sample")
    ap.add_argument("--capacity", type=int, required=True, help="samples in flight before producers wait")
    ap.add_argument("--parent-pid", type=int, default=0, help="exit when this process is gone")
    ap.add_argument("--warehouses", type=int, default=1, help="number of warehouses that will register")
    ap.add_argument("--views", default="", help='JSON {"consumer": {"reads": [...], "whole_groups": false}}: '
                    "each consumer's fixed reads (default: fixed by its first claim)")
    ap.add_argument("--block", type=int, default=1, help="samples per ownership block: sample k lives on "
                    "warehouse (k // block) %% warehouses; > 1 lets a producer reserve on its own node's warehouse")
    DockLimits.add_arguments(ap)
    args = ap.parse_args(argv)
    logging.basicConfig(level=os.environ.get("STREAMRL_LOG", "WARNING"), format="%(name)s: %(message)s")
    try:
        server = ControllerServer(
            args.bind, [c for c in args.consumers.split(",") if c], args.capacity, args.warehouses,
            secret=secret_from_env(),  # from the environment, never argv (readable by any local user)
            limits=DockLimits.from_args(args), views=parse_views(args.views) if args.views else None,
            curve=RunKeys.from_env(),  # CURVE keys, like the secret: from the environment, never argv
            block=args.block,
        )
    except (ValueError, zmq.ZMQError, msgspec.DecodeError) as exc:
        print(f"controller: {exc}", file=sys.stderr)
        return 2
    server.parent.pid = args.parent_pid
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    print(f"READY {server.endpoint}", flush=True)
    gc.freeze()  # start-up objects never die: keep the collector from rescanning them on every claim
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
