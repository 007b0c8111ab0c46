"""A producer faster than its consumer blocks at capacity; memory held stays bounded."""

from __future__ import annotations

import time

import anyio
import torch

from streamrl.dock.client import DockClient
from streamrl.dock.launch import LocalDock

CAPACITY = 8
SAMPLE_BYTES = 256 * 1024


def test_fast_producer_waits_and_memory_stays_bounded() -> None:
    peak = {"in_flight": 0, "bytes": 0}

    async def main(dock: LocalDock) -> None:
        async with DockClient(dock.controller_endpoint) as prod, DockClient(dock.controller_endpoint) as cons:
            put_times: list[float] = []

            async def producer() -> None:
                for _ in range(40):
                    await prod.add({"x": [torch.zeros(SAMPLE_BYTES // 4)]}, timeout=30)
                    put_times.append(time.monotonic())
                await prod.close_input()

            async def consumer() -> None:
                async for batch in cons.stream("train", ["x"], 1, idle_timeout=30):
                    await anyio.sleep(0.02)  # slow consumer: 50 samples/s at most
                    s = await cons.server_statistics()
                    peak["in_flight"] = max(peak["in_flight"], s["controller"]["in_flight"])
                    peak["bytes"] = max(peak["bytes"], sum(w["bytes_held"] for w in s["warehouses"]))
                    await cons.ack(batch.lease)

            t0 = time.monotonic()
            async with anyio.create_task_group() as tg:
                tg.start_soon(producer)
                tg.start_soon(consumer)
            # without backpressure the producer would finish its 40 puts almost at once
            assert put_times[-1] - t0 > 0.02 * (40 - CAPACITY) * 0.8

    with LocalDock(["train"], capacity=CAPACITY) as dock:
        anyio.run(main, dock)
    assert peak["in_flight"] <= CAPACITY
    assert peak["bytes"] <= CAPACITY * SAMPLE_BYTES
