"""The async client against a real dock (controller + 2 warehouses as processes) over tcp and ipc."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

import anyio
import pytest
import torch

from streamrl.dock.client import DockClient
from streamrl.dock.errors import DockFull, DockTimeout, EndOfStream, NothingToClaim, RemoteError
from streamrl.dock.launch import LocalDock

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool]


def _value(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    return (torch.randn(shape) * 50).to(dtype)


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_round_trip_of_every_dtype_and_shape_over_real_sockets(transport: str) -> None:
    shapes = [(), (0,), (1,), (13,), (4, 3), (1 << 17,)]  # 0-d, empty, ragged, 2-d, above zero-copy size

    async def main(dock: LocalDock) -> None:
        async with DockClient(dock.controller_endpoint) as c:
            n = len(shapes)
            columns = {f"c_{str(dt)[6:]}": [_value(dt, s) for s in shapes] for dt in DTYPES}
            columns["meta"] = [{"k": i, "s": "x" * i} for i in range(n)]
            idx = await c.add(columns)
            await c.close_input()
            lease = await c.claim("gen", list(columns), n, min_n=n, timeout=10)
            assert sorted(lease.indices) == sorted(idx)
            got = await c.fetch(idx, list(columns))
            for name, vals in columns.items():
                for want, have in zip(vals, got[name], strict=True):
                    if isinstance(want, torch.Tensor):
                        assert have.dtype == want.dtype and have.shape == want.shape
                        assert torch.equal(have, want)
                    else:
                        assert have == want
            await c.ack(lease)

    with LocalDock(["gen"], capacity=64, n_warehouses=2, transport=transport) as dock:  # type: ignore[arg-type]
        anyio.run(main, dock)
        if sys.platform == "linux":
            # the warehouses stored and served every dtype without torch (codec.RawValue): none of its
            # libraries is mapped in them (a warehouse starts in a fraction of a second)
            for pid in dock.pids[1:]:
                assert "libtorch" not in Path(f"/proc/{pid}/maps").read_text(), f"warehouse {pid} loaded torch"
        if transport == "ipc":
            assert dock.ipc_files()
        ipc_dir = dock._ipc_dir
    assert ipc_dir is None or not __import__("os").path.exists(ipc_dir)  # no stale ipc files


def test_pipeline_flow_groups_versions_and_end_of_stream(dock: LocalDock) -> None:
    async def main() -> None:
        async with DockClient(dock.controller_endpoint) as c:
            idx = await c.add({"x": [torch.tensor([i]) for i in range(16)]}, group_size=4)
            with pytest.raises(NothingToClaim):
                await c.claim_nowait("train", ["x", "y"], 8, whole_groups=True)
            lease = await c.claim("gen", ["x"], 16, min_n=16, timeout=10)
            await c.put(lease.indices, {"y": [torch.ones(i) for i in range(16)]},
                        versions=[7] * 16, lengths=list(range(16)))
            await c.ack(lease)
            await c.close_input()
            seen = []
            async for batch in c.stream("train", ["x", "y"], 8, whole_groups=True, idle_timeout=10):
                assert len({s.group for s in batch.lease.samples}) == 2  # two whole groups of 4
                assert batch.lease.versions == [7] * 8
                assert [t.numel() for t in batch.columns["y"]] == batch.lease.lengths
                seen.extend(batch.indices)
                await c.ack(batch.lease)
            assert sorted(seen) == idx
            with pytest.raises(EndOfStream):
                await c.claim("train", ["x", "y"], 8, whole_groups=True, timeout=2)
            stats = await c.server_statistics()
            assert stats["controller"]["in_flight"] == 0  # every consumer acked: freed
            # the controller tells the warehouses asynchronously: they drop the data shortly after
            with anyio.fail_after(5):
                while not all(w["samples"] == 0 and w["bytes_held"] == 0 for w in stats["warehouses"]):
                    await anyio.sleep(0.02)
                    stats = await c.server_statistics()

    anyio.run(main)


def test_bad_requests_get_clear_errors_and_the_servers_keep_serving(dock: LocalDock) -> None:
    async def main() -> None:
        async with DockClient(dock.controller_endpoint, request_timeout_s=10) as c:
            idx = await c.add({"x": [torch.zeros(1)]})
            with pytest.raises(RemoteError, match="write-once"):
                await c.put(idx, {"x": [torch.zeros(1)]})
            with pytest.raises(RemoteError, match="not written yet"):
                await c.fetch(idx, ["nope"])
            with pytest.raises(RemoteError, match="not registered"):
                await c.claim("nobody", ["x"], 1, timeout=1)
            with pytest.raises(RemoteError, match="exceeds the dock capacity"):
                await c.reserve(10_000)
            with pytest.raises(RemoteError, match="multiple of group_size"):
                await c.reserve(3, group_size=2)
            lease = await c.claim("gen", ["x"], 1, timeout=5)
            await c.ack(lease)
            with pytest.raises(RemoteError, match="not held"):
                await c.ack(lease)
            assert (await c.fetch(idx, ["x"]))["x"][0].tolist() == [0.0]

    anyio.run(main)


def test_a_put_carries_its_leases_ack_to_both_warehouses(dock: LocalDock) -> None:
    """docs/dock-protocol.md §5.7: put(..., ack=lease) acks the put's samples for the lease's
    consumer once their columns are ready; the samples are split over the two warehouses."""
    async def main() -> None:
        async with DockClient(dock.controller_endpoint) as c:
            idx = await c.add({"x": [torch.tensor([i]) for i in range(8)]})
            lease = await c.claim("gen", ["x"], 8, min_n=8, timeout=10)
            assert {c._owner(i) for i in lease.indices} == {0, 1}
            await c.ack(lease, lease.indices[:2], discard=True)  # a stage's drops go first, on their own
            kept = lease.indices[2:]
            await c.put(kept, {"y": [torch.ones(2)] * 6}, ack=lease)
            st = await c.controller_statistics()
            assert st["consumers"]["gen"]["done"] == 8 and st["consumers"]["gen"]["claimed"] == 0
            assert st["leases"] == 0 and st["put_acks"] == 2  # one per warehouse's part
            assert c.statistics()["leases_held"] == 0
            with pytest.raises(RemoteError, match="not held"):
                await c.ack(lease)
            got = await c.claim("train", ["x", "y"], 8, min_n=6, timeout=10)
            assert sorted(got.indices) == sorted(kept) and set(idx) >= set(kept)
            await c.ack(got)

    anyio.run(main)


def test_stats_long_poll_is_answered_when_a_watched_figure_changes(dock: LocalDock) -> None:
    """docs/dock-protocol.md §5.9: a stats request with ``watch`` and the ``seen`` token waits for a
    change of those consumers' done/claimed counts or of the drop counts, and for nothing else."""
    async def main() -> None:
        async with DockClient(dock.controller_endpoint) as c, DockClient(dock.controller_endpoint) as poller:
            first = await poller.controller_statistics(watch=["gen"])  # no seen: at once
            token = first["watched"]
            t0 = anyio.current_time()
            same = await poller.controller_statistics(watch=["gen"], seen=token, timeout=0.3)
            assert same["watched"] == token and anyio.current_time() - t0 >= 0.25  # answered at its timeout
            with anyio.fail_after(10):
                answers: list[dict] = []

                async def wait_for_change() -> None:
                    answers.append(await poller.controller_statistics(watch=["gen"], seen=token, timeout=8))

                async with anyio.create_task_group() as tg:
                    tg.start_soon(wait_for_change)
                    await anyio.sleep(0.1)
                    assert (await c.controller_statistics())["pending_stats"] == 1
                    idx = await c.add({"x": [torch.tensor([i]) for i in range(4)]})  # ready counts: not watched
                    lease = await c.claim("train", ["x"], 4, min_n=4, timeout=5)  # another consumer's claim
                    await anyio.sleep(0.2)
                    assert not answers
                    await c.ack(lease)
                    await anyio.sleep(0.2)
                    assert not answers
                    t1 = anyio.current_time()
                    lease = await c.claim("gen", ["x"], 4, min_n=4, timeout=5)  # gen's claimed count moves
                # well before the poll's 8 s timeout
                assert anyio.current_time() - t1 < 2 and answers[0]["watched"] != token
                assert answers[0]["consumers"]["gen"]["claimed"] == 4
            # a discard by any consumer changes every watch's token (the dock's drop counts)
            token = answers[0]["watched"]
            async with anyio.create_task_group() as tg:
                answers.clear()
                tg.start_soon(wait_for_change)
                await anyio.sleep(0.1)
                other = await poller.controller_statistics(watch=["train"])
                await c.ack(lease, idx[:2], discard=True)
            assert answers[0]["samples_discarded"] == 2 and answers[0]["watched"] != token
            assert (await poller.controller_statistics(watch=["train"]))["watched"] != other["watched"]
            with pytest.raises(RemoteError, match="consumer 'nobody' is not registered"):
                await poller.controller_statistics(watch=["nobody"])
            with pytest.raises(RemoteError, match="name the consumers to watch"):
                await poller.controller_statistics(seen=1)
            assert (await c.controller_statistics())["pending_stats"] == 0

    anyio.run(main)


def test_reserve_nowait_raises_dock_full_and_reserve_times_out() -> None:
    async def main(dock: LocalDock) -> None:
        async with DockClient(dock.controller_endpoint) as c:
            await c.reserve(4)
            with pytest.raises(DockFull):
                await c.reserve_nowait(1)
            with pytest.raises(DockTimeout):
                await c.reserve(1, timeout=0.3)

    with LocalDock(["gen"], capacity=4) as dock:
        anyio.run(main, dock)


def test_client_timeout_when_no_dock_answers() -> None:
    async def main() -> None:
        with pytest.raises(DockTimeout, match="did not answer"):
            async with DockClient("tcp://127.0.0.1:9", connect_timeout_s=0.5):
                pass

    anyio.run(main)


def test_a_claim_cancelled_in_the_loop_turn_its_grant_arrives_in_is_released() -> None:
    """The worker's prefetching claim is cancelled when its stage fails (tests/runtime/test_worker.py).
    Where the cancel and the grant's reply came in the same turn of the event loop, the reply's
    callback ran first: it found the request's future cancelled and dropped the reply, and the
    request's own clean-up, which runs later, no longer found the request pending either; the
    lease stayed on the controller until its TTL. Here the grant is in the socket, and the cancel
    is queued ahead of the reply's callback, before the loop turns again."""

    def produce(endpoint: str, granted: threading.Event) -> None:
        # in another thread, while the consumer's event loop is held: the put wakes the parked claim
        async def main() -> None:
            async with DockClient(endpoint) as c:
                await c.add({"x": [torch.tensor([1])]})
                with anyio.fail_after(10):
                    while (await c.server_statistics())["controller"]["claimed"] == 0:
                        await anyio.sleep(0.005)
                await anyio.sleep(0.2)  # the grant's reply on its way to the consumer's socket
            granted.set()

        anyio.run(main)

    async def main(dock: LocalDock) -> None:
        async with DockClient(dock.controller_endpoint) as consumer, DockClient(dock.controller_endpoint) as other:
            got = []
            async with anyio.create_task_group() as tg:
                scope = anyio.CancelScope()

                async def claim() -> None:
                    with scope:
                        got.append(await consumer.claim("gen", ["x"], 1, timeout=30))

                tg.start_soon(claim)
                with anyio.fail_after(10):  # the claim parked on the controller
                    while (await other.server_statistics())["controller"]["pending_claims"] == 0:
                        await anyio.sleep(0.005)
                granted = threading.Event()
                producer = threading.Thread(target=produce, args=(dock.controller_endpoint, granted))
                producer.start()
                producer.join(15)  # the event loop held: the reply waits in the socket
                assert granted.is_set()
                asyncio.get_running_loop().call_soon(scope.cancel)  # ahead of the reply's callback
            assert not got  # cancelled before the lease reached it
            deadline = time.monotonic() + 5  # the release goes out without waiting for its answer
            while (stats := (await other.server_statistics())["controller"])["leases"] and time.monotonic() < deadline:
                await anyio.sleep(0.01)
            assert (stats["leases"], stats["claimed"]) == (0, 0), "the lease granted to the cancelled claim stayed"

    with LocalDock(["gen"], capacity=8) as dock:
        anyio.run(main, dock)
