"""A consumer killed with SIGKILL while holding a lease: its samples go to another consumer."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import anyio
import torch

from streamrl.dock.client import DockClient
from streamrl.dock.launch import LocalDock

from .procs import spawn_worker, stop_all


def test_kill_9_lease_holder_samples_are_redelivered_none_lost() -> None:
    with LocalDock(["train"], capacity=64) as dock, tempfile.TemporaryDirectory() as tmp:
        procs = []
        try:
            async def produce() -> None:
                async with DockClient(dock.controller_endpoint) as c:
                    await c.add({"x": [torch.tensor([i]) for i in range(24)]})
                    await c.close_input()

            anyio.run(produce)
            holder = spawn_worker("hold", dock.controller_endpoint, "train", "8", "--ttl", "0.5")
            procs.append(holder)
            assert holder.stdout is not None
            line = holder.stdout.readline()  # blocks until HELD (the worker's claim has a 30 s timeout)
            assert line.startswith("HELD "), holder.stderr.read() if holder.stderr else line
            held = [int(i) for i in line.split()[1:]]
            assert len(held) == 8
            holder.kill()  # SIGKILL: no goodbye, its lease must expire by TTL
            holder.wait(timeout=10)
            t_kill = time.monotonic()
            out = str(Path(tmp) / "rescuer.json")
            rescuer = spawn_worker("consume", dock.controller_endpoint, "train", "5", out)
            procs.append(rescuer)
            assert rescuer.wait(timeout=60) == 0, rescuer.stderr.read() if rescuer.stderr else ""
            elapsed = time.monotonic() - t_kill
            got = json.loads(Path(out).read_text())
            assert sorted(got) == list(range(24))  # includes the 8 the dead worker held
            assert set(held) <= set(got)
            assert elapsed < 30

            async def stats() -> dict:
                async with DockClient(dock.controller_endpoint) as c:
                    return (await c.server_statistics())["controller"]

            s = anyio.run(stats)
            assert s["leases_expired"] == 1 and s["samples_released"] == 8 and s["in_flight"] == 0
        finally:
            stop_all(procs)
