"""Data locality: with an ownership block > 1 a producer reserves samples its own warehouse owns.

owner(k) = (k // block) % W. Unit tests of the allocation (ControllerState), then a real dock
(servers in threads, real tcp sockets) with W=2, block=8.
"""

from __future__ import annotations

from collections.abc import Iterator

import anyio
import pytest
import torch

from streamrl.dock import protocol as p
from streamrl.dock.client import DockClient
from streamrl.dock.errors import RemoteError
from streamrl.dock.launch import ThreadDock
from streamrl.dock.state import ControllerState, ProtocolViolation


def test_owner_rule() -> None:
    assert [p.owner(k, 3) for k in range(7)] == [0, 1, 2, 0, 1, 2, 0]  # block 1: k % W, as always
    assert [p.owner(k, 2, 4) for k in range(12)] == [0] * 4 + [1] * 4 + [0] * 4


def test_groups_stay_inside_the_blocks_of_the_asked_warehouse() -> None:
    st = ControllerState(["c"], capacity=1000, n_warehouses=2, block=8)
    idx, groups = st.reserve(12, 3, warehouse=0)
    # block [0, 8): groups 0-2, 3-5; 6-7 cannot hold a group of 3; next block of warehouse 0 is [16, 24)
    assert idx == [0, 1, 2, 3, 4, 5, 16, 17, 18, 19, 20, 21]
    assert groups == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    idx, _ = st.reserve(8, 4, warehouse=1)
    assert idx == list(range(8, 16))
    idx, _ = st.reserve(4, 4, warehouse=1)
    assert idx == list(range(24, 28))  # the cursor skipped warehouse 0's block [16, 24)
    assert st.reserve(2, 2, warehouse=0)[0] == [22, 23]  # fills warehouse 0's block to its end
    assert st.reserve(3, 3, warehouse=0)[0] == [32, 33, 34]  # its next block: [32, 40)
    assert st.reserve(6, 3, warehouse=1)[0] == [28, 29, 30, 40, 41, 42]  # 31 stays unused: no straddling
    assert all(st.owner(i) == 0 for i in [0, 5, 16, 21, 22, 32]) and st.owner(40) == 1
    # no warehouse named: round robin over the warehouses, one per reserve
    a, _ = st.reserve(2, 1)
    b, _ = st.reserve(2, 1)
    assert a == [35, 36] and b == [43, 44]
    stats = st.statistics()
    assert stats["reserved_total"] == 39 and stats["reserved_per_warehouse"] == [19, 20]
    assert stats["block"] == 8


def test_reserve_refusals_name_the_field() -> None:
    st = ControllerState(["c"], capacity=100, n_warehouses=2, block=8)
    with pytest.raises(ProtocolViolation, match=r"group_size=16 exceeds .* block=8") as exc:
        st.check_reserve(16, 16, warehouse=1)
    assert exc.value.code == "bad_field"
    with pytest.raises(ProtocolViolation, match="warehouse=2 outside"):
        st.check_reserve(4, 4, warehouse=2)
    with pytest.raises(ValueError, match="block"):
        ControllerState(["c"], capacity=100, n_warehouses=2, block=0)


def test_block_1_keeps_todays_allocation_and_end_of_stream_with_holes() -> None:
    plain = ControllerState(["c"], capacity=100, n_warehouses=2)
    assert plain.reserve(4, 2, warehouse=1)[0] == [0, 1, 2, 3]  # block 1: warehouse is only a hint
    assert plain.reserve(3, 1)[0] == [4, 5, 6]
    assert plain.statistics()["reserved_per_warehouse"] == [4, 3]
    # block > 1: indices skip block tails, yet the stream still ends once every sample is done
    st = ControllerState(["c"], capacity=100, n_warehouses=2, block=4)
    idx, _ = st.reserve(6, 3, warehouse=1)
    assert idx == [4, 5, 6, 12, 13, 14]
    st.columns_ready(idx, ["x"], None, None)
    st.input_closed = True
    claim = p.Claim(1, "w", "c", ["x"], n=6, min_n=6)
    lease = st.try_claim(claim, st.validate_claim(claim), force=False)
    assert lease is not None and sorted(s.index for s in lease.samples) == idx
    st.ack("w", lease.lease_id, None)
    assert st.at_end(0) and sorted(st.take_freed()) == idx


@pytest.fixture
def dock() -> Iterator[ThreadDock]:
    with ThreadDock(["gen"], capacity=64, n_warehouses=2, block=8) as d:
        yield d


def test_a_producer_writes_to_its_own_warehouse_and_a_remote_claim_is_counted(dock: ThreadDock) -> None:
    async def main() -> None:
        async with (DockClient(dock.controller_endpoint, home_warehouse=1, request_timeout_s=10) as producer,
                    DockClient(dock.controller_endpoint, home_warehouse=0, request_timeout_s=10) as consumer):
            assert producer.block == 8
            values = [torch.full((3,), float(k)) for k in range(16)]
            idx = await producer.add({"x": values}, group_size=4)
            assert all((i // 8) % 2 == 1 for i in idx), idx  # every index in a block of warehouse 1
            stats = await producer.server_statistics()
            assert [w["samples_stored"] for w in stats["warehouses"]] == [0, 16]  # only warehouse 1 stored them
            assert stats["controller"]["reserved_per_warehouse"] == [0, 16]

            lease = await consumer.claim("gen", ["x"], 16, min_n=16, whole_groups=True, timeout=10)
            assert sorted(lease.indices) == sorted(idx)
            got = await consumer.fetch(lease.indices, ["x"])
            want = dict(zip(idx, values, strict=True))
            for i, v in zip(lease.indices, got["x"], strict=True):
                assert torch.equal(v, want[i])
            await consumer.ack(lease)
            stats = await consumer.server_statistics()
            ctl = stats["controller"]
            assert (ctl["claimed_remote"], ctl["claimed_local"]) == (16, 0)
            assert [w["gets"] for w in stats["warehouses"]] == [0, 1]

            # a claim by a client on warehouse 1's node is local
            idx = await producer.add({"x": values[:4]}, group_size=4)
            lease = await producer.claim("gen", ["x"], 4, min_n=4, whole_groups=True, timeout=10)
            await producer.ack(lease)
            ctl = (await producer.server_statistics())["controller"]
            assert (ctl["claimed_remote"], ctl["claimed_local"]) == (16, 4)

            # a group larger than the block is refused, naming the field
            with pytest.raises(RemoteError, match="group_size=16") as exc:
                await producer.reserve(16, group_size=16, timeout=0)
            assert exc.value.code == "bad_field"

    anyio.run(main)


def test_a_home_warehouse_outside_the_dock_is_refused(dock: ThreadDock) -> None:
    async def main() -> None:
        with pytest.raises(RemoteError, match="home_warehouse=2 outside"):
            async with DockClient(dock.controller_endpoint, home_warehouse=2, connect_timeout_s=5):
                pass

    anyio.run(main)
