"""ControllerState semantics, exercised directly (no sockets) so hypothesis can try many interleavings."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamrl.dock import protocol as p
from streamrl.dock.state import ControllerState, ProtocolViolation

CONSUMERS = ["gen", "train"]


def claim(state: ControllerState, consumer: str, n: int, client: str = "c1", **kw: object) -> p.Claimed | None:
    req = p.Claim(1, client, consumer, ["x"], n, **kw)  # type: ignore[arg-type]
    view = state.validate_claim(req)
    return state.try_claim(req, view, force=True)


@pytest.mark.parametrize("reserve_ttl_s", [None, 2.0])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_random_interleavings_deliver_each_sample_once_per_consumer_and_lose_none(
    data: st.DataObject, reserve_ttl_s: float | None
) -> None:
    """With reserve expiry (a clock that ticks) and discards, every sample is acked by each consumer,
    expired unwritten, or discarded before that consumer claimed it: exactly one, never twice."""
    group_size = data.draw(st.sampled_from([1, 2, 4]), label="group_size")
    whole = {c: data.draw(st.booleans(), label=f"whole_groups[{c}]") for c in CONSUMERS}
    state = ControllerState(CONSUMERS, capacity=16, n_warehouses=2, reserve_ttl_s=reserve_ttl_s)
    now = 0.0
    expired: list[int] = []
    acked: dict[str, list[int]] = {c: [] for c in CONSUMERS}
    leases: dict[int, tuple[str, str, set[int]]] = {}  # lease -> (consumer, client, indices)
    discarded: set[int] = set()
    reserve_of: dict[int, int] = {}  # sample -> the reserve call that made it

    def do_claim(consumer: str, client: str, n: int, one_reserve: bool) -> None:
        reply = claim(state, consumer, n, client, whole_groups=whole[consumer], one_reserve=one_reserve)
        if reply and reply.samples:
            got = {s.index for s in reply.samples}
            if one_reserve:
                assert len({reserve_of[i] for i in got}) == 1, "a one_reserve claim mixed reserves"
            for _, (c, _, held) in leases.items():
                assert c != consumer or not (held & got), "a sample leased twice to one consumer"
            assert not (got & set(acked[consumer])), "an acked sample was delivered again"
            assert not (got & discarded), "a discarded sample was delivered"
            if whole[consumer]:
                starts = {s.index - s.index % group_size for s in reply.samples}
                for g in starts:  # whole groups: every still-pending member comes together
                    members = {i for i in range(g, g + group_size)
                               if i not in acked[consumer] and i not in expired and i not in discarded}
                    assert members <= got
            leases[reply.lease_id] = (consumer, client, got)

    for _ in range(data.draw(st.integers(5, 60), label="steps")):
        op = data.draw(st.sampled_from(["reserve", "ready", "claim", "ack", "discard", "release", "expire", "tick"]))
        if op == "reserve" and state.free_slots >= group_size * 2:
            made, _ = state.reserve(group_size * data.draw(st.integers(1, 2)), group_size, now=now)
            reserve_of.update(dict.fromkeys(made, len(set(reserve_of.values()))))
        elif op == "tick":
            now += data.draw(st.floats(0.0, 3.0))
            expired.extend(state.expire_reservations(now))
        elif op == "ready" and state.samples:
            live = sorted(state.samples)
            chosen = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=len(live), unique=True))
            state.columns_ready(chosen, ["x"], None, None)
        elif op == "claim":
            do_claim(data.draw(st.sampled_from(CONSUMERS)), data.draw(st.sampled_from(["c1", "c2"])),
                     data.draw(st.integers(1, 8)), data.draw(st.booleans(), label="one_reserve"))
        elif op == "ack" and leases:
            lid = data.draw(st.sampled_from(sorted(leases)))
            consumer, client, held = leases.pop(lid)
            state.ack(client, lid, None)
            acked[consumer].extend(held)
        elif op == "discard" and leases:
            lid = data.draw(st.sampled_from(sorted(leases)))
            consumer, client, held = leases.pop(lid)
            state.ack(client, lid, None, discard=True)
            acked[consumer].extend(held)
            discarded.update(held)
        elif op == "release" and leases:
            lid = data.draw(st.sampled_from(sorted(leases)))
            consumer, client, _ = leases.pop(lid)
            state.release(client, lid)
        elif op == "expire":
            client = data.draw(st.sampled_from(["c1", "c2"]))
            state.expire_client(client)
            for lid in [lid for lid, (_, c, _) in leases.items() if c == client]:
                del leases[lid]

    # drain: all columns ready, every consumer claims and acks until nothing is left
    state.columns_ready(sorted(state.samples), ["x"], None, None)
    for lid, (consumer, client, held) in list(leases.items()):
        state.ack(client, lid, None)
        acked[consumer].extend(held)
    state.input_closed = True
    for consumer in CONSUMERS:
        while (reply := claim(state, consumer, 8, whole_groups=whole[consumer])) and reply.samples:
            state.ack("c1", reply.lease_id, None)
            acked[consumer].extend(s.index for s in reply.samples)
        assert reply is not None and reply.end
    for consumer in CONSUMERS:
        skipped = sorted(discarded - set(acked[consumer]))  # discarded before this consumer claimed them
        assert sorted(acked[consumer] + expired + skipped) == list(range(state.next_index)), \
            f"{consumer}: lost or duplicated"
    assert not state.samples and state.free_slots == state.capacity


def test_claims_cost_o_claimed_not_o_capacity() -> None:
    """With 50k samples ready, a claim of 8 touches the queue's head only."""
    state = ControllerState(["a"], capacity=50_000, n_warehouses=1)
    idx, _ = state.reserve(50_000, 1)
    state.columns_ready(idx, ["x"], None, None)
    import time

    t0 = time.perf_counter()
    for _ in range(1000):
        reply = claim(state, "a", 8)
        assert reply is not None
        state.ack("c1", reply.lease_id, None)
    per_claim = (time.perf_counter() - t0) / 1000
    assert per_claim < 1e-3, f"claim+ack took {per_claim * 1e6:.0f} us with 50k samples live"


def test_min_version_drops_stale_samples_for_that_consumer_only() -> None:
    state = ControllerState(["train", "log"], capacity=8, n_warehouses=1)
    idx, _ = state.reserve(4, 1)
    state.columns_ready(idx, ["x"], [0, 1, 2, 3], None)
    reply = claim(state, "train", 8, min_version=2)
    assert reply is not None and [s.index for s in reply.samples] == [2, 3] and reply.dropped_stale == 2
    reply = claim(state, "log", 8)
    assert reply is not None and len(reply.samples) == 4


def test_balance_by_length_picks_samples_of_similar_length() -> None:
    state = ControllerState(["train"], capacity=16, n_warehouses=1)
    idx, _ = state.reserve(8, 1)
    state.columns_ready(idx, ["x"], None, [30, 2, 29, 3, 31, 1, 28, 4])
    reply = claim(state, "train", 4, balance_by_length=True)
    assert reply is not None
    assert sorted(s.length for s in reply.samples) == [1, 2, 3, 4]
    rest = claim(state, "train", 4)
    assert rest is not None and sorted(s.length for s in rest.samples) == [28, 29, 30, 31]


@pytest.mark.parametrize("whole_groups", [False, True])
def test_a_one_reserve_claim_takes_the_samples_of_one_reserve(whole_groups: bool) -> None:
    """A source's step is one reserve: a generator claiming with one_reserve never holds two steps'
    prompts, however many are ready, and samples given back come alone, ahead of the next step's."""
    state = ControllerState(["gen"], capacity=16, n_warehouses=1)
    first, _ = state.reserve(4, 2)
    second, _ = state.reserve(4, 2)
    state.columns_ready(first + second, ["x"], None, None)
    reply = claim(state, "gen", 8, whole_groups=whole_groups, one_reserve=True)
    assert reply is not None and [s.index for s in reply.samples] == first
    state.release("c1", reply.lease_id)  # back to the front of the queue, ahead of the second reserve
    reply = claim(state, "gen", 8, whole_groups=whole_groups, one_reserve=True)
    assert reply is not None and [s.index for s in reply.samples] == first
    state.ack("c1", reply.lease_id, None)
    reply = claim(state, "gen", 8, whole_groups=whole_groups, one_reserve=True)
    assert reply is not None and [s.index for s in reply.samples] == second
    third, _ = state.reserve(4, 2)
    fourth, _ = state.reserve(4, 2)
    state.columns_ready(third + fourth, ["x"], None, None)
    reply = claim(state, "gen", 8, whole_groups=whole_groups)  # without it: both
    assert reply is not None and [s.index for s in reply.samples] == third + fourth


@pytest.mark.parametrize("oldest_first", [True, False])
@pytest.mark.parametrize("whole_groups", [False, True])
def test_leases_returned_in_any_order_leave_the_oldest_reserve_at_the_front(whole_groups: bool,
                                                                           oldest_first: bool) -> None:
    """A generator that dies holding step s (being generated) and step s+1 (prefetched): whichever
    lease comes back first, the restarted one claims step s first. Were step s+1 in front, it would
    wait for a version that needs step s trained, and step s would wait behind it."""
    state = ControllerState(["gen"], capacity=24, n_warehouses=1)
    steps = [state.reserve(4, 2)[0] for _ in range(3)]
    state.columns_ready([i for step in steps for i in step], ["x"], None, None)
    held = [claim(state, "gen", 8, whole_groups=whole_groups, one_reserve=True) for _ in range(2)]
    assert [[s.index for s in lease.samples] for lease in held if lease] == steps[:2]
    for lease in (held if oldest_first else reversed(held)):
        assert lease is not None
        state.release("c1", lease.lease_id)
    order = []
    while (reply := claim(state, "gen", 8, whole_groups=whole_groups, one_reserve=True)) and reply.samples:
        order.append([s.index for s in reply.samples])
        state.ack("c1", reply.lease_id, None)
    assert order == steps


def test_a_one_reserve_claim_balances_lengths_within_its_reserve() -> None:
    state = ControllerState(["train"], capacity=16, n_warehouses=1)
    first, _ = state.reserve(4, 1)
    second, _ = state.reserve(4, 1)
    state.columns_ready(first + second, ["x"], None, [30, 2, 29, 3, 1, 4, 2, 3])
    reply = claim(state, "train", 2, balance_by_length=True, one_reserve=True)
    assert reply is not None and sorted(s.length for s in reply.samples) == [2, 3]  # not the 1..4 of the second
    reply = claim(state, "train", 4, balance_by_length=True, one_reserve=True)
    assert reply is not None and [s.index for s in reply.samples] == [first[0], first[2]]


def test_whole_groups_wait_for_the_last_member() -> None:
    state = ControllerState(["adv"], capacity=8, n_warehouses=1)
    idx, groups = state.reserve(8, 4)
    assert groups == [0] * 4 + [1] * 4
    state.columns_ready(idx[:7], ["x"], None, None)
    reply = claim(state, "adv", 8, whole_groups=True)
    assert reply is not None and [s.index for s in reply.samples] == [0, 1, 2, 3]
    state.columns_ready([7], ["x"], None, None)
    reply = claim(state, "adv", 8, whole_groups=True)
    assert reply is not None and [s.index for s in reply.samples] == [4, 5, 6, 7]


def test_min_n_is_waived_for_the_last_samples_of_a_closed_input() -> None:
    state = ControllerState(["train"], capacity=8, n_warehouses=1)
    idx, _ = state.reserve(3, 1)
    state.columns_ready(idx, ["x"], None, None)
    req = p.Claim(1, "c", "train", ["x"], 8, min_n=8)
    assert state.try_claim(req, state.validate_claim(req), force=False) is None
    state.input_closed = True
    reply = state.try_claim(req, state.validate_claim(req), force=False)
    assert reply is not None and len(reply.samples) == 3


@pytest.mark.parametrize(
    ("call", "code"),
    [
        (lambda s: s.reserve(3, 2), "bad_field"),
        (lambda s: s.reserve(100, 1), "bad_field"),
        (lambda s: s.ack("c", 99, None), "unknown_lease"),
        (lambda s: s.validate_claim(p.Claim(1, "c", "nobody", ["x"], 1)), "unknown_consumer"),
        (lambda s: s.validate_claim(p.Claim(1, "c", "a", ["x"], 0)), "bad_field"),
    ],
)
def test_bad_requests_are_protocol_violations_with_codes(call, code: str) -> None:  # type: ignore[no-untyped-def]
    state = ControllerState(["a"], capacity=8, n_warehouses=1)
    with pytest.raises(ProtocolViolation) as info:
        call(state)
    assert info.value.code == code


def test_constructor_validates() -> None:
    with pytest.raises(ValueError, match="at least one consumer"):
        ControllerState([], 8, 1)
    with pytest.raises(ValueError, match="unique"):
        ControllerState(["a", "a"], 8, 1)
    with pytest.raises(ValueError, match="capacity"):
        ControllerState(["a"], 0, 1)


def test_ack_with_duplicate_indices_counts_each_sample_once() -> None:
    state = ControllerState(["a"], capacity=4, n_warehouses=1)
    idx, _ = state.reserve(2, 1)
    state.columns_ready(idx, ["x"], None, None)
    reply = claim(state, "a", 2)
    assert reply is not None
    state.ack("c1", reply.lease_id, [idx[0], idx[0], idx[1]])
    assert state.done_count == [2] and state.claimed_count == [0] and not state.samples


def test_a_puts_ack_is_applied_once_and_skips_what_is_done_or_gone() -> None:
    """docs/dock-protocol.md §5.7: the ack a put carries reaches the controller in columns_ready,
    which a warehouse resends after a link reset: applied twice it must ack nothing more and raise
    nothing; a lease this client no longer holds acks nothing."""
    state = ControllerState(["a", "b"], capacity=8, n_warehouses=2)
    idx, _ = state.reserve(4, 1)
    state.columns_ready(idx, ["x"], None, None)
    reply = claim(state, "a", 4)
    assert reply is not None
    state.columns_ready(idx[:2], ["y"], None, None)  # the first warehouse's part of the put
    assert state.ack_with_put("c1", reply.lease_id, idx[:2]) == {0}
    assert state.ack_with_put("c1", reply.lease_id, idx[:2]) == set()  # resent: nothing twice
    assert state.ack_with_put("other", reply.lease_id, idx[2:]) == set()  # not this client's lease
    assert state.done_count == [2, 0] and state.claimed_count == [2, 0]
    state.columns_ready(idx[2:], ["y"], None, None)
    assert state.ack_with_put("c1", reply.lease_id, idx[2:]) == {0}
    assert state.done_count == [4, 0] and state.claimed_count == [0, 0] and not state.leases
    assert state.ack_with_put("c1", reply.lease_id, idx[2:]) == set()  # the lease is gone: skipped
    assert state.counters["put_acks"] == 5 and state.counters["put_acks_skipped"] == 3


def test_policy_a_puts_ack_only_from_the_leases_consumer_role() -> None:
    state = _policy_state()
    idx, _ = state.reserve(2, 1, role="stage:src")
    state.columns_ready(idx, ["x"], None, None, "stage:src")
    req = p.Claim(1, "g1", "gen", ["x"], 2)
    reply = state.try_claim(req, state.validate_claim(req, "stage:gen"), force=True)
    assert reply is not None
    with pytest.raises(ProtocolViolation) as exc:
        state.check_put_ack("g1", reply.lease_id, "stage:train")
    assert exc.value.code == "forbidden"
    state.check_put_ack("g1", reply.lease_id, "stage:gen")
    state.check_put_ack("g1", 10**6, "stage:train")  # no such lease: nothing to refuse, nothing acked


def test_group_members_released_after_the_first_member_was_freed_are_claimable() -> None:
    """The group's size must not come from its first member, which may be gone."""
    state = ControllerState(["adv"], capacity=8, n_warehouses=1)
    idx, _ = state.reserve(4, 4)
    state.columns_ready(idx, ["x"], None, None)
    reply = claim(state, "adv", 4, whole_groups=True)
    assert reply is not None and len(reply.samples) == 4
    state.ack("c1", reply.lease_id, [idx[0]])  # frees sample 0 (the only consumer acked it)
    assert idx[0] not in state.samples
    state.release("c1", reply.lease_id)
    again = claim(state, "adv", 4, whole_groups=True)
    assert again is not None and sorted(s.index for s in again.samples) == idx[1:]


def test_a_consumer_that_reads_nothing_sees_samples_reserved_after_its_first_claim() -> None:
    state = ControllerState(["counter"], capacity=8, n_warehouses=1)
    state.reserve(1, 1)
    req = p.Claim(1, "c", "counter", [], 8)
    first = state.try_claim(req, state.validate_claim(req), force=True)
    assert first is not None and len(first.samples) == 1
    state.reserve(2, 1)
    later = state.try_claim(req, state.validate_claim(req), force=True)
    assert later is not None and len(later.samples) == 2


def test_stale_dropping_is_proportional_to_what_it_drops() -> None:
    import time

    state = ControllerState(["train"], capacity=60_000, n_warehouses=1)
    idx, _ = state.reserve(50_000, 1)
    state.columns_ready(idx, ["x"], [5] * 50_000, None)
    t0 = time.perf_counter()
    for _ in range(200):
        reply = claim(state, "train", 8, min_version=3)
        assert reply is not None and reply.dropped_stale == 0
        state.ack("c1", reply.lease_id, None)
    assert (time.perf_counter() - t0) / 200 < 1e-3


def test_declared_views_are_fixed_before_any_claim_and_must_cover_every_consumer() -> None:
    from streamrl.dock.state import ConsumerView

    with pytest.raises(ValueError, match="undeclared"):
        ControllerState(["gen", "train"], 8, 1, {"gen": ConsumerView(["x"])})
    state = ControllerState(["gen"], 8, 1, {"gen": ConsumerView(["x", "y"], whole_groups=True)})
    idx, _ = state.reserve(2, 2)
    state.columns_ready(idx, ["x", "y"], None, None)
    with pytest.raises(ProtocolViolation, match=r"'gen' is declared .* reads=\['x', 'y'\] whole_groups=True"):
        state.validate_claim(p.Claim(1, "c", "gen", ["x"], 2, whole_groups=True))
    with pytest.raises(ProtocolViolation, match="whole_groups=True"):
        state.validate_claim(p.Claim(1, "c", "gen", ["y", "x"], 2))
    req = p.Claim(1, "c", "gen", ["y", "x"], 2, whole_groups=True)  # order does not matter
    got = state.try_claim(req, state.validate_claim(req), force=False)
    assert got is not None and sorted(s.index for s in got.samples) == idx  # queued before the first claim


def test_distinct_column_names_are_bounded() -> None:
    state = ControllerState(["gen"], 8, 1)
    idx, _ = state.reserve(1, 1)
    state.columns_ready(idx, [f"c{k}" for k in range(p.MAX_COLUMNS)], None, None)
    with pytest.raises(ProtocolViolation) as exc:
        state.columns_ready(idx, ["one_too_many"], None, None)
    assert exc.value.code == "too_many_columns"
    state.columns_ready(idx, ["c0"], None, None)  # known names stay fine


# ---------------------------------------------------------------- authorization (issue 25)
def _policy_state(reserve_ttl_s: float | None = 5.0) -> ControllerState:
    from streamrl.dock.authz import DockPolicy
    from streamrl.dock.state import ConsumerView

    policy = DockPolicy(columns={"x": "src", "y": "gen"}, stage_reads={"src": [], "gen": ["x"], "train": ["x", "y"]},
                        producers=["src"], clients={"stage:src": 2, "stage:gen": 2, "stage:train": 2, "launcher": 1})
    views = {"gen": ConsumerView(["x"]), "train": ConsumerView(["x", "y"])}
    return ControllerState(["gen", "train"], capacity=8, n_warehouses=1, views=views, policy=policy,
                           reserve_ttl_s=reserve_ttl_s)


def test_policy_column_names_are_declared_up_front_and_no_message_adds_one() -> None:
    state = _policy_state()
    (i,), _ = state.reserve(1, 1, role="stage:src")
    with pytest.raises(ProtocolViolation) as exc:
        state.columns_ready([i], ["junk"], None, None, "stage:src")
    assert exc.value.code == "unknown_column" and "'junk'" in str(exc.value)
    assert sorted(state.column_bits) == ["x", "y"]


def test_policy_only_the_owner_marks_a_column_written() -> None:
    state = _policy_state()
    (i,), _ = state.reserve(1, 1, role="stage:src")
    for role in ("stage:gen", "stage:train", "launcher"):
        with pytest.raises(ProtocolViolation) as exc:
            state.columns_ready([i], ["x"], None, None, role)
        assert exc.value.code == "forbidden" and role in str(exc.value) and "'src'" in str(exc.value)
    assert state.samples[i].ready == 0
    state.columns_ready([i], ["x"], None, None, "stage:src")
    assert state.samples[i].ready


def test_policy_claims_acks_and_releases_only_as_the_roles_own_consumer() -> None:
    state = _policy_state()
    idx, _ = state.reserve(2, 1, role="stage:src")
    state.columns_ready(idx, ["x"], None, None, "stage:src")
    req = p.Claim(1, "t1", "gen", ["x"], 2)
    for role in ("stage:train", "launcher", "stage:src"):
        with pytest.raises(ProtocolViolation) as exc:
            state.validate_claim(req, role)
        assert exc.value.code == "forbidden"
    view = state.validate_claim(req, "stage:gen")
    reply = state.try_claim(req, view, force=True)
    assert reply is not None and len(reply.samples) == 2
    with pytest.raises(ProtocolViolation) as exc:
        state.ack("t1", reply.lease_id, None, role="stage:train")
    assert exc.value.code == "forbidden"
    with pytest.raises(ProtocolViolation) as exc:
        state.release("t1", reply.lease_id, role="stage:train")
    assert exc.value.code == "forbidden"
    assert state.ack("t1", reply.lease_id, None, role="stage:gen") == {0}


def test_policy_only_producers_reserve_and_close_the_input() -> None:
    state = _policy_state()
    for role in ("stage:gen", "stage:train", "launcher"):
        with pytest.raises(ProtocolViolation) as exc:
            state.reserve(1, 1, role=role)
        assert exc.value.code == "forbidden"
        with pytest.raises(ProtocolViolation):
            state.close_input(role)
    assert state.free_slots == 8 and not state.input_closed
    state.close_input("stage:src")
    assert state.input_closed


def test_reserved_samples_expire_unless_their_creators_columns_are_written() -> None:
    state = _policy_state(reserve_ttl_s=5.0)
    written, _ = state.reserve(2, 1, role="stage:src", now=100.0)
    lost, _ = state.reserve(6, 1, role="stage:src", now=101.0)
    assert state.free_slots == 0
    state.columns_ready(written, ["x"], None, None, "stage:src")
    assert state.expire_reservations(104.9) == []
    assert state.expire_reservations(105.0) == []  # the first reserve's samples were written
    assert sorted(state.expire_reservations(106.0)) == lost
    assert state.free_slots == 6 and sorted(state.take_freed()) == lost
    assert state.statistics()["reservations_expired"] == 6
    # the consumers' end of stream counts the expired ones as never made
    state.close_input("stage:src")
    view = state.validate_claim(p.Claim(1, "g", "gen", ["x"], 8), "stage:gen")
    reply = state.try_claim(p.Claim(1, "g", "gen", ["x"], 8), view, force=True)
    assert reply is not None and sorted(s.index for s in reply.samples) == written
    state.ack("g", reply.lease_id, None, role="stage:gen")
    assert state.at_end(0) and not state.at_end(1)


def test_reserve_expiry_without_a_policy_counts_any_column_as_written() -> None:
    state = ControllerState(CONSUMERS, capacity=4, n_warehouses=1, reserve_ttl_s=1.0)
    idx, _ = state.reserve(4, 1, now=0.0)
    state.columns_ready(idx[:1], ["x"], None, None)  # written
    claim(state, "gen", 1)  # fixes gen's view to reads ["x"]
    assert sorted(state.expire_reservations(2.0)) == idx[1:]
    assert sorted(state.samples) == idx[:1]


def test_an_expired_member_does_not_hold_back_the_rest_of_its_group_for_a_whole_group_consumer() -> None:
    from streamrl.dock.state import ConsumerView

    state = ControllerState(["adv"], capacity=4, n_warehouses=1, views={"adv": ConsumerView(["x"], True)},
                            reserve_ttl_s=1.0)
    idx, _ = state.reserve(4, 4, now=0.0)
    state.columns_ready(idx[:3], ["x"], None, None)  # one member is never written
    assert state.expire_reservations(2.0) == idx[3:]
    req = p.Claim(1, "a", "adv", ["x"], 4, whole_groups=True)
    reply = state.try_claim(req, state.validate_claim(req), force=False)
    assert reply is not None and sorted(s.index for s in reply.samples) == idx[:3]


def test_discard_drops_samples_for_every_consumer_that_has_not_claimed_them() -> None:
    """A filter's discard: pending consumers never get the samples, whatever their view (queued
    whole groups, per-sample queues, not yet ready); one that holds them claimed acks as usual."""
    state = ControllerState(["filter", "adv", "train", "ref"], capacity=16, n_warehouses=1)
    idx, _ = state.reserve(8, 4)  # two groups of 4
    state.columns_ready(idx, ["reward", "x"], None, None)
    ref = claim(state, "ref", 8)  # the reference stage holds all eight while the filter decides
    adv_req = p.Claim(1, "c", "adv", ["reward"], 8, whole_groups=True)
    state.validate_claim(adv_req)  # adv's view exists and has both groups queued
    train_req = p.Claim(1, "c", "train", ["x", "advantage"], 8)
    state.validate_claim(train_req)  # train's view exists; nothing ready for it yet
    assert state.ready_count(state.views[1]) == 8
    flt = claim(state, "filter", 8, whole_groups=True)
    assert flt is not None and ref is not None
    touched = state.ack("c1", flt.lease_id, idx[:4], discard=True)  # drop the first group
    assert touched == {0, 1, 2}  # filter, adv and train had them pending; ref has them claimed
    assert state.counters["samples_discarded"] == 4
    assert state.ready_count(state.views[1]) == 4
    got = state.try_claim(adv_req, state.views[1], force=True)
    assert got is not None and sorted(s.index for s in got.samples) == idx[4:]
    state.columns_ready(idx, ["advantage"], None, None)  # a late column does not revive them for train
    got = state.try_claim(train_req, state.views[2], force=True)
    assert got is not None and sorted(s.index for s in got.samples) == idx[4:]
    state.ack("c1", flt.lease_id, None)
    state.ack("c1", ref.lease_id, None)  # ref was the last holder of the discarded group: freed
    assert all(i not in state.samples for i in idx[:4])
    assert state.done_count == [8, 4, 4, 8]


def test_discard_of_part_of_a_queued_group_keeps_the_rest_claimable() -> None:
    state = ControllerState(["filter", "adv"], capacity=8, n_warehouses=1)
    idx, _ = state.reserve(4, 4)
    state.columns_ready(idx, ["reward", "x"], None, None)
    adv_req = p.Claim(1, "c", "adv", ["reward"], 4, whole_groups=True)
    state.validate_claim(adv_req)
    flt = claim(state, "filter", 4)
    assert flt is not None
    state.ack("c1", flt.lease_id, idx[:3], discard=True)
    assert state.ready_count(state.views[1]) == 1
    got = state.try_claim(adv_req, state.views[1], force=True)
    assert got is not None and [s.index for s in got.samples] == idx[3:]
    state.ack("c1", flt.lease_id, [idx[3]], discard=True)  # claimed by adv: it keeps its lease
    state.ack("c", got.lease_id, None)
    assert not state.samples and state.counters["samples_discarded"] == 4


def test_a_whole_group_given_back_after_one_member_was_discarded_is_claimable_again() -> None:
    """The group's lease is released after another consumer discarded one of its members: the rest
    of the group goes back to the queue (found by the interleavings test: the discarded member, still
    CLAIMED while the others were queued, kept the group out of the queue for good)."""
    state = ControllerState(["gen", "train"], capacity=8, n_warehouses=1)
    idx, _ = state.reserve(2, 2)
    state.columns_ready(idx, ["x"], None, None)
    train = claim(state, "train", 2, whole_groups=True)
    assert train is not None and [s.index for s in train.samples] == idx
    gen = claim(state, "gen", 1)
    assert gen is not None and [s.index for s in gen.samples] == idx[:1]
    state.ack("c1", gen.lease_id, None, discard=True)  # train holds it CLAIMED: it keeps its lease
    state.release("c1", train.lease_id)
    again = claim(state, "train", 2, whole_groups=True)
    assert again is not None and [s.index for s in again.samples] == idx[1:]


def test_a_sample_given_back_says_how_often_it_was_returned_to_that_consumer_only() -> None:
    """``SampleInfo.returned``: 0 on a first delivery; one more per release or lease expiry of that
    consumer (what lets an agent stage drop the samples of a dead worker's sessions); another
    consumer's first delivery of the same sample still says 0."""
    state = ControllerState(["agent", "train"], capacity=8, n_warehouses=1)
    idx, _ = state.reserve(2, 1)
    state.columns_ready(idx, ["x"], None, None)
    first = claim(state, "agent", 8, client="worker0")
    assert first is not None and [s.returned for s in first.samples] == [0, 0]
    state.release("worker0", first.lease_id)
    again = claim(state, "agent", 1, client="worker0")
    assert again is not None and [(s.index, s.returned) for s in again.samples] == [(0, 1)]
    state.expire_client("worker0")  # the worker died holding sample 0; sample 1 went back with the release
    last = claim(state, "agent", 8, client="worker1")
    assert last is not None and sorted((s.index, s.returned) for s in last.samples) == [(0, 2), (1, 1)]
    state.ack("worker1", last.lease_id, None)
    train = claim(state, "train", 8, client="trainer")
    assert train is not None and [s.returned for s in train.samples] == [0, 0]
    assert p.SampleInfo(0, 0, 1, 0, 3, 2) == msgspec.msgpack.decode(
        msgspec.msgpack.encode(p.SampleInfo(0, 0, 1, 0, 3, 2)), type=p.SampleInfo)
    # a 5-element array (a controller older than the field) reads as returned 0
    assert msgspec.msgpack.decode(msgspec.msgpack.encode([0, 0, 1, 0, 3]), type=p.SampleInfo).returned == 0
