"""Several consumer processes claim concurrently: each sample reaches each consumer exactly once."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import anyio
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamrl.dock.client import DockClient
from streamrl.dock.launch import LocalDock

from .procs import spawn_worker, stop_all

PLANS = given(
    n_samples=st.integers(20, 120),
    workers=st.lists(st.tuples(st.sampled_from(["gen", "train"]), st.integers(1, 9)), min_size=2, max_size=4),
    ack_delay=st.sampled_from([0.0, 0.01]),
    seed=st.integers(0, 1000),
)


@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
@PLANS
def test_each_sample_reaches_each_consumer_exactly_once(
    n_samples: int, workers: list[tuple[str, int]], ack_delay: float, seed: int
) -> None:
    """Two plans of 3-5 consumer processes (each example starts its processes: seconds apiece)."""
    _each_sample_once(n_samples, workers, ack_delay, seed)


@pytest.mark.slow
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@PLANS
def test_each_sample_reaches_each_consumer_exactly_once_over_more_plans(
    n_samples: int, workers: list[tuple[str, int]], ack_delay: float, seed: int
) -> None:
    """The slow tier: the same over eight plans."""
    _each_sample_once(n_samples, workers, ack_delay, seed)


def _each_sample_once(n_samples: int, workers: list[tuple[str, int]], ack_delay: float, seed: int) -> None:
    consumers = sorted({c for c, _ in workers} | {"gen", "train"})
    with LocalDock(consumers, capacity=32, n_warehouses=2) as dock, tempfile.TemporaryDirectory() as tmp:
        procs = []
        outs = []
        try:
            # every consumer name gets at least one worker, so the stream can drain
            plan = workers + [(c, 4) for c in consumers if c not in {w for w, _ in workers}]
            for k, (consumer, n) in enumerate(plan):
                out = str(Path(tmp) / f"w{k}.json")
                outs.append((consumer, out))
                procs.append(spawn_worker("consume", dock.controller_endpoint, consumer, str(n), out,
                                          "--ack-delay", str(ack_delay), "--seed", str(seed + k)))

            async def produce() -> None:
                # bounded: a consumer that died (e.g. could not import streamrl) would leave the
                # producer waiting for capacity forever
                with anyio.fail_after(120):
                    await produce_all()

            async def produce_all() -> None:
                async with DockClient(dock.controller_endpoint) as c:
                    for start in range(0, n_samples, 7):  # capacity 32 < n_samples: backpressure too
                        k = min(7, n_samples - start)
                        idx = await c.reserve(k)
                        await c.put(idx, {"x": [torch.tensor([i, i]) for i in idx]})
                    await c.close_input()

            anyio.run(produce)
            for proc in procs:
                assert proc.wait(timeout=60) == 0, proc.stderr.read() if proc.stderr else ""
        finally:
            stop_all(procs)
        delivered: dict[str, list[int]] = {c: [] for c in consumers}
        for consumer, out in outs:
            delivered[consumer].extend(json.loads(Path(out).read_text()))
        for consumer in consumers:
            assert sorted(delivered[consumer]) == list(range(n_samples)), consumer
