"""The dock controller's bookkeeping, with no sockets: :class:`ControllerState`.

State per live sample: its group, policy version, length, a bitmask of the columns that are
ready, and per consumer one of PENDING / CLAIMED / DONE. Per consumer a *view* (the columns it
reads and whether it claims whole groups: declared at start by the launcher, which knows the
pipeline, or else fixed by the consumer's first claim) keeps a FIFO of samples
(or groups) that are ready and pending for it. A column becoming ready appends to the views it
completes; a claim pops from the front. So a claim costs O(samples claimed), never O(capacity).

Leases: claimed samples belong to a lease of the claiming client. The server
(:mod:`streamrl.dock.controller`) renews a client's leases on each of its messages and calls
:meth:`ControllerState.expire_client` when the client stays silent past its lease TTL; the
client's samples then go back to the front of the pool. A sample is freed (and, through the
server, the warehouse told to drop it) once every registered consumer is DONE.

Every method is a plain call that returns a reply or raises :class:`ProtocolViolation`, so the
state machine is tested without a socket (``tests/dock/test_controller_state.py``)::

    state = ControllerState(["score", "train"], capacity=64, n_warehouses=1)
    indices, groups = state.reserve(4, group_size=4)
    state.columns_ready(indices, ["tokens"], versions=None, lengths=None)
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from streamrl.dock import protocol as p

if TYPE_CHECKING:
    from streamrl.dock.authz import DockPolicy

PENDING, CLAIMED, DONE = 0, 1, 2

class ProtocolViolation(Exception):
    """A request that is well-formed but not allowed; answered with an ErrorReply, never fatal."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class _Sample:
    __slots__ = ("discarded", "group", "group_size", "group_start", "index", "length", "n_done", "ready",
                 "reserve", "returned", "state", "version")

    def __init__(self, index: int, group: int, group_start: int, group_size: int, n_consumers: int,
                 reserve: int = 0) -> None:
        self.index = index
        self.reserve = reserve  # the serial number of the reserve that allocated it (claims with one_reserve)
        self.group = group
        self.group_start = group_start
        self.group_size = group_size
        self.version = 0
        self.length = 0
        self.ready = 0  # bitmask over column ids
        self.state = bytearray(n_consumers)
        self.n_done = 0
        self.discarded = False  # left the run (an ack with discard): never delivered again
        # per consumer: claims of it that ended without an ack (released, or the lease expired); made on
        # the first such return, so a sample never given back costs nothing
        self.returned: bytearray | None = None


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


class ControllerState:
    """All controller bookkeeping, independent of sockets (unit-testable, deterministic)."""

    def __init__(
        self,
        consumers: list[str],
        capacity: int,
        n_warehouses: int,
        views: Mapping[str, ConsumerView] | None = None,
        block: int = 1,
        policy: DockPolicy | None = None,
        reserve_ttl_s: float | None = None,
    ) -> None:
        """``policy``: the pipeline's declarations (column names and owners, consumers, producers),
        enforced on the role each method is given (None: no authentication, names only).
        ``reserve_ttl_s``: reserved samples not written within this many seconds expire
        (:meth:`expire_reservations`); None: never (unit tests that drive no clock)."""
        if not consumers:
            raise ValueError("the dock needs at least one consumer: the stage names that must ack each sample")
        if len(set(consumers)) != len(consumers):
            raise ValueError(f"consumer names must be unique, got {consumers}")
        if capacity < 1:
            raise ValueError(f"capacity (samples in flight) must be >= 1, got {capacity}")
        if not 1 <= block <= p.MAX_BLOCK:
            raise ValueError(f"block (samples per ownership block) must be in [1, {p.MAX_BLOCK}], got {block}")
        self.consumers = list(consumers)
        self.policy = policy
        self.reserve_ttl_s = reserve_ttl_s
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
        self.reserves = 0  # reserve calls so far: a sample's ``reserve`` is the serial number of its own
        self.next_lease = itertools.count(1)
        self.leases: dict[int, _Lease] = {}
        self.client_leases: dict[str, set[int]] = {}
        self.input_closed = False
        # reserved samples whose creator has not written them yet: index -> the columns that make
        # them written (the reserving stage's declared writes; 0: any column, without a policy)
        self.unwritten: dict[int, int] = {}
        self.reserve_deadlines: deque[tuple[float, list[int]]] = deque()  # FIFO: one TTL for all
        self.n_expired = 0  # reserved samples that expired unwritten (never delivered to anyone)
        self.to_free: list[int] = []  # freed indices not yet announced to the warehouses
        self.counters = dict.fromkeys(
            ("reserved", "claims", "samples_claimed", "samples_acked", "samples_freed",
             "samples_released", "dropped_stale", "samples_discarded", "leases_expired", "errors", "claimed_local", "claimed_remote",
             "reservations_expired", "put_acks", "put_acks_skipped"),
            0,
        )
        if policy is not None:
            if len(policy.columns) > p.MAX_COLUMNS:
                raise ValueError(f"the pipeline declares {len(policy.columns)} columns, more than {p.MAX_COLUMNS}")
            for column in policy.columns:  # every bit up front: no message can add a column
                self.column_bits[column] = 1 << len(self.column_bits)
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

    def check_producer(self, role: str | None, what: str = "reserve") -> None:
        """Only a producing stage reserves samples or closes the input (role None: no authentication)."""
        if self.policy is not None:
            self.policy.check_producer(role, what)

    def reserve(self, n: int, group_size: int, warehouse: int | None = None, *, role: str | None = None,
                now: float = 0.0) -> tuple[list[int], list[int]]:
        """Allocate ``n`` new sample indices in groups of ``group_size``; caller checked capacity.

        block 1: the next ``n`` indices (``warehouse`` is ignored). block > 1: groups inside blocks
        owned by ``warehouse`` (round robin over the warehouses, one per reserve, when None).
        ``role``: the reserving client's (only producers may); the samples are *written* once that
        stage's declared columns are all ready, and expire at ``now + reserve_ttl_s`` if not."""
        self.check_producer(role)
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
        self.reserves += 1
        serial = self.reserves
        for start in starts:
            g = self.next_group
            self.next_group += 1
            for i in range(start, start + group_size):
                self.samples[i] = _Sample(i, g, start, group_size, nc, serial)
                indices.append(i)
                groups.append(g)
                for view in self.views:  # a consumer that reads nothing may claim it at once
                    if view is not None and view.reads_mask == 0:
                        self._enqueue(view, self.samples[i], front=False)
        self.n_reserved += n
        self.counters["reserved"] += n
        if self.reserve_ttl_s is not None:
            written = self._creator_mask(role)
            for i in indices:
                self.unwritten[i] = written
            self.reserve_deadlines.append((now + self.reserve_ttl_s, indices))
        return indices, groups

    def _creator_mask(self, role: str | None) -> int:
        """Columns that make a sample reserved by ``role`` written: the stage's declared writes (with
        a policy and a role), else 0 (any column)."""
        if self.policy is None or role is None:
            return 0
        stage = role[len("stage:"):] if role.startswith("stage:") else None
        return self._mask([c for c, owner in self.policy.columns.items() if owner == stage])

    def expire_reservations(self, now: float) -> list[int]:
        """Reserved samples still unwritten at their deadline: freed, their capacity returned.

        A producer that reserves and never writes (died between reserve and put, or misbehaves)
        would otherwise hold capacity for ever: reserved samples have no lease. Only samples no
        consumer can claim yet expire (a sample some view finds ready is on its way through the
        pipeline). Returns the expired indices (the server tells their warehouses to drop any data)."""
        expired: list[int] = []
        while self.reserve_deadlines and self.reserve_deadlines[0][0] <= now:
            _, indices = self.reserve_deadlines.popleft()
            for i in indices:
                if self.unwritten.pop(i, None) is None:
                    continue  # written in time (or freed)
                s = self.samples.get(i)
                if s is None or any(v is not None and (s.ready & v.reads_mask) == v.reads_mask for v in self.views):
                    continue
                # never claimable, so never claimed: PENDING for every consumer and in no queue
                del self.samples[i]
                self.to_free.append(i)
                expired.append(i)
                self._requeue_group(s)
        self.n_expired += len(expired)
        self.counters["reservations_expired"] += len(expired)
        return expired

    def _requeue_group(self, gone: _Sample) -> None:
        """``gone`` left its group unclaimed (expired): whole-group views count it as done, so the
        rest of its group may be claimable now; nothing else would queue it (no column event)."""
        if gone.group_size == 1:
            return
        rest = [self.samples[i] for i in range(gone.group_start, gone.group_start + gone.group_size)
                if i in self.samples]
        for view in self.views:
            if view is not None and view.whole_groups and rest:
                self._enqueue(view, rest[0], front=False)

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
            if self.policy is not None:  # declared up front: a message names no new column
                self.policy.check_columns([column])
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
        role: str | None = None,
    ) -> tuple[set[int], list[int]]:
        """Mark columns ready. Returns (consumers with new claimable samples, unknown indices).

        ``role``: the role that wrote them (the warehouse forwards its putter's); with a policy
        only the owning stage may (None: no authentication, declared names only)."""
        if self.policy is not None:
            self.policy.check_write(role, columns)
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
            need = self.unwritten.get(i)
            if need is not None and (s.ready & need) == need and (need or s.ready):
                del self.unwritten[i]  # written by its creator: it no longer expires
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
        return self.n_reserved - self.n_expired - self.done_count[consumer] - self.claimed_count[consumer]

    def at_end(self, consumer: int) -> bool:
        return self.input_closed and self.done_count[consumer] == self.n_reserved - self.n_expired

    # ------------------------------------------------------------------ claims and leases
    def validate_claim(self, req: p.Claim, role: str | None = None) -> _View:
        """The claim's view; with a policy, ``role`` must be the consumer's own stage."""
        if self.policy is not None:
            self.policy.check_consumer(role, req.consumer, "claim")
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
        picked = self._pop(view, req.n, req.balance_by_length, req.one_reserve)
        lease = _Lease(next(self.next_lease), req.client_id, view.consumer, set(picked))
        self.leases[lease.lease_id] = lease
        self.client_leases.setdefault(req.client_id, set()).add(lease.lease_id)
        infos = []
        for i in picked:
            s = self.samples[i]
            s.state[view.consumer] = CLAIMED
            self.claimed_count[view.consumer] += 1
            returned = s.returned[view.consumer] if s.returned is not None else 0
            infos.append(p.SampleInfo(i, s.group, s.group_size, s.version, s.length, returned))
        home = self.client_home.get(req.client_id)
        if home is not None:  # locality statistics, only for clients that said where they run
            local = sum(1 for i in picked if self.owner(i) == home)
            self.counters["claimed_local"] += local
            self.counters["claimed_remote"] += len(picked) - local
        self.counters["claims"] += 1
        self.counters["samples_claimed"] += len(picked)
        return p.Claimed(req.req_id, lease.lease_id, infos, dropped, False)

    def _pop(self, view: _View, n: int, balance: bool, one_reserve: bool = False) -> list[int]:
        """Take a claim's samples from the front of ``view``'s queue; ``one_reserve``: only those of
        the reserve of the first one taken (the queue is FIFO, so they lead it)."""
        queue = view.queue
        if not view.whole_groups:
            # length balancing looks at a window of 4n: the n samples of closest lengths, so a
            # micro-batch pads little; the others go back to the front in their old order
            width = min(4 * n if balance else n, len(queue))
            if one_reserve and queue:
                reserve = self.samples[queue[0]].reserve
                width = next((k for k, i in enumerate(itertools.islice(queue, width))
                              if self.samples[i].reserve != reserve), width)
            if not balance or width <= n:
                return [queue.popleft() for _ in range(min(n, width))]
            window = [queue.popleft() for _ in range(width)]
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
        reserve: int | None = None
        while view.queue:
            start = view.queue[0]
            members = [
                i
                for i in range(start, start + view.queued_groups[start])
                if i in self.samples and self.samples[i].state[view.consumer] == PENDING
            ]
            if picked and len(picked) + len(members) > n:
                break  # whole groups only: the next group would overflow the micro-batch
            if one_reserve and members:
                if reserve is None:
                    reserve = self.samples[members[0]].reserve
                elif self.samples[members[0]].reserve != reserve:
                    break  # the next group came from another reserve
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

    def _held(self, client_id: str, lease_id: int) -> _Lease | None:
        """Lease ``lease_id`` if client ``client_id`` holds it now, else None."""
        lease = self.leases.get(lease_id)
        return lease if lease is not None and lease.client_id == client_id else None

    def _lease_of(self, client_id: str, lease_id: int, role: str | None, what: str) -> _Lease:
        lease = self._held(client_id, lease_id)
        if lease is None:
            raise ProtocolViolation(
                "unknown_lease",
                f"lease {lease_id} is not held by client {client_id!r} (expired after the lease TTL, "
                "already acked, or released)",
            )
        if self.policy is not None:  # leases are granted to the consumer's role only; checked again
            self.policy.check_consumer(role, self.consumers[lease.consumer], what)
        return lease

    def ack(self, client_id: str, lease_id: int, indices: list[int] | None, role: str | None = None,
            *, discard: bool = False) -> set[int]:
        """Mark (some of) a lease's samples DONE; returns the consumers that may now be answered
        (the lease's own; with ``discard`` also every consumer the samples were dropped for).

        ``discard``: the samples leave the run. Every other consumer for which a sample is still
        PENDING is marked DONE for it without delivery (it leaves that consumer's queue); one that
        holds it CLAIMED keeps its lease and acks it as usual (released or expired, it is done for
        that consumer too: a discarded sample is never delivered again)."""
        lease = self._lease_of(client_id, lease_id, role, "ack")
        targets = list(lease.indices) if indices is None else list(dict.fromkeys(indices))  # no duplicates
        stray = [i for i in targets if i not in lease.indices]
        if stray:
            raise ProtocolViolation("bad_field", f"indices {stray[:8]} are not in lease {lease_id}")
        touched = {lease.consumer}
        for i in targets:
            lease.indices.discard(i)
            self.claimed_count[lease.consumer] -= 1
            s = self.samples[i]
            if discard:
                touched |= self._discard(s, lease.consumer)
            self._mark_done(s, lease.consumer)
        self.counters["samples_acked"] += len(targets)
        if discard:
            self.counters["samples_discarded"] += len(targets)
        if not lease.indices:
            self._drop_lease(lease)
        return touched

    def check_put_ack(self, client_id: str, lease_id: int, role: str | None = None) -> None:
        """Before a ``columns_ready`` that carries a put's ack is applied: the putter's role must be
        the lease's consumer's (refused as a separate ack would be). A lease this client no longer
        holds is no error here: :meth:`ack_with_put` skips it."""
        lease = self._held(client_id, lease_id)
        if lease is not None and self.policy is not None:
            self.policy.check_consumer(role, self.consumers[lease.consumer], "ack")

    def ack_with_put(self, client_id: str, lease_id: int, indices: list[int], role: str | None = None) -> set[int]:
        """A put's ack, forwarded in its ``columns_ready`` (docs/dock-protocol.md §5.7): ``indices``
        done for the lease's consumer, as :meth:`ack` does, but applied once. Indices no longer in
        the lease, or a lease this client no longer holds, are skipped without an error: the
        ``columns_ready`` may be a resend, or the lease may have expired and gone to another worker
        (whose own put then finds the columns written)."""
        lease = self._held(client_id, lease_id)
        still = [i for i in indices if i in lease.indices] if lease is not None else []
        self.counters["put_acks"] += 1
        if len(still) < len(indices):
            self.counters["put_acks_skipped"] += 1
        return self.ack(client_id, lease_id, still, role) if still else set()

    def _discard(self, s: _Sample, by: int) -> set[int]:
        """DONE without delivery for every consumer but ``by`` that has ``s`` PENDING; returns them."""
        touched: set[int] = set()
        s.discarded = True
        for view_id, state in enumerate(s.state):
            if view_id == by or state != PENDING:
                continue
            touched.add(view_id)
            view = self.views[view_id]
            if view is not None:
                self._unqueue(view, s)
            self._mark_done(s, view_id)
        return touched

    def _unqueue(self, view: _View, s: _Sample) -> None:
        """Take PENDING ``s`` out of ``view``'s queue before it is marked DONE there (O(queue):
        discards are rare next to claims)."""
        if not view.whole_groups:
            if (s.ready & view.reads_mask) == view.reads_mask:
                view.queue.remove(s.index)
            return
        start = s.group_start
        if start not in view.queued_groups:
            return
        view.queued_pending -= 1
        left = [i for i in range(start, start + s.group_size) if i != s.index and i in self.samples
                and self.samples[i].state[view.consumer] == PENDING]
        if not left:  # the queued group has nothing left to deliver
            view.queue.remove(start)
            del view.queued_groups[start]

    def release(self, client_id: str, lease_id: int, role: str | None = None) -> int:
        """Give a lease's unacked samples back (front of the queue). Returns the consumer id."""
        lease = self._lease_of(client_id, lease_id, role, "release")
        self._return_lease(lease)
        return lease.consumer

    def _return_lease(self, lease: _Lease) -> None:
        self._drop_lease(lease)
        view = self.views[lease.consumer]
        assert view is not None
        self.claimed_count[lease.consumer] -= len(lease.indices)
        back: list[_Sample] = []
        # first every sample's new state, then the queue: a whole group is queued only once none of
        # its members is CLAIMED, so a member still to be marked (here DONE, as discarded) must not
        # be seen CLAIMED by the enqueue of the others
        for i in sorted(lease.indices, reverse=True):
            s = self.samples[i]
            if s.discarded:  # another consumer discarded it meanwhile: nothing to deliver again
                self._mark_done(s, lease.consumer)
                continue
            s.state[lease.consumer] = PENDING
            if s.returned is None:
                s.returned = bytearray(len(s.state))
            s.returned[lease.consumer] = min(s.returned[lease.consumer] + 1, 255)  # a count that saturates
            back.append(s)
        queued = 0
        for s in back:
            if (s.ready & view.reads_mask) == view.reads_mask:
                queued += self._enqueue(view, s, front=True)
        self._behind_older_reserves(view, queued)
        self.counters["samples_released"] += len(lease.indices)

    def _entry_reserve(self, view: _View, entry: int) -> int:
        """The reserve serial of a queue entry (a sample, or a whole group's start)."""
        size = view.queued_groups.get(entry, 1) if view.whole_groups else 1
        for i in range(entry, entry + size):
            s = self.samples.get(i)
            if s is not None:
                return s.reserve
        return 0

    def _behind_older_reserves(self, view: _View, returned: int) -> None:
        """The ``returned`` entries just put back at the front of ``view``'s queue go behind the
        queued entries of older reserves, which leases returned before them put there: the queue's
        front stays in reserve order whatever order leases come back in, so a claim with
        ``one_reserve`` takes the oldest step's samples first (a generator that took a newer step's
        would wait for a version that needs the older one trained). Returns are rare (a released or
        expired lease): this costs O(entries moved)."""
        queue = view.queue
        if not returned:
            return
        back = [queue.popleft() for _ in range(returned)]
        newest = max(self._entry_reserve(view, e) for e in back)
        older: list[int] = []
        while queue and self._entry_reserve(view, queue[0]) < newest:
            older.append(queue.popleft())
        # stable: within one reserve the returned entries stay ahead, each list in its own order
        queue.extendleft(reversed(sorted(back + older, key=lambda e: self._entry_reserve(view, e))))

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

    def close_input(self, role: str | None = None) -> None:
        """No more samples will be reserved; only a producing stage may say so."""
        self.check_producer(role, "close_input")
        self.input_closed = True

    def take_freed(self) -> list[int]:
        freed, self.to_free = self.to_free, []
        return freed

    def watched(self, consumers: Sequence[int]) -> int:
        """The ``watched`` token of a stats long poll (docs/dock-protocol.md §5.9): a function of these
        consumers' done and claimed counts and of the dock's drop counts, so equal figures give an
        equal token and a change of any of them (almost surely) another."""
        c = self.counters
        figures = [c["samples_discarded"], c["dropped_stale"]]
        for cid in consumers:
            figures += (self.done_count[cid], self.claimed_count[cid])
        return hash(tuple(figures)) & p.INT63

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
            "reserved_unwritten": len(self.unwritten),
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
