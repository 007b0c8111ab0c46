"""Versioned inference weights (shared leases, exclusive updates) and the host swap, in one process."""

from __future__ import annotations

import anyio
import pytest
import torch

from streamrl.reshard import (
    InferenceWeights,
    ModelShardingSpec,
    ShardedTrainEngine,
    SwapStateError,
    TrainGroups,
    TrainLayout,
    TrainStateOffloadedError,
    VersionError,
    WeightsUnavailableError,
)
from tests.reshard.reshard_harness import build_model, tiny_config
from tests.reshard.reshard_workers import batches, lm_loss

SHAPES = {"w": (2, 3), "b": (3,)}


def _weights() -> InferenceWeights:
    return InferenceWeights(SHAPES, dtype=torch.float32, device="cpu")


def test_wait_version_returns_once_the_version_is_published() -> None:
    weights = _weights()
    seen: list[tuple[str, int]] = []

    async def main() -> None:
        async def waiter(v: int) -> None:
            seen.append((f"wait {v}", await weights.wait_version(v)))

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter, 1)
            tg.start_soon(waiter, 3)
            await anyio.sleep(0.01)
            assert seen == []
            async with weights.update() as tensors:
                tensors["w"].fill_(1.0)
                weights.publish(2)
            await anyio.sleep(0.01)
            assert seen == [("wait 1", 2)]  # a version >= 1 is enough; 3 keeps waiting
            with pytest.raises(TimeoutError):
                await weights.wait_version(9, timeout_s=0.01)
            async with weights.update():
                weights.publish(3)

    anyio.run(main)
    assert seen == [("wait 1", 2), ("wait 3", 3)]


def test_update_waits_for_leases_and_new_readers_wait_for_the_update() -> None:
    weights = _weights()
    events: list[str] = []

    async def main() -> None:
        async with weights.update():
            weights.publish(1)

        async def writer() -> None:
            async with weights.update() as tensors:
                events.append("update starts")
                tensors["w"].fill_(2.0)
                weights.publish(2)
            events.append("update done")

        async def late_reader() -> None:
            async with weights.use(1) as tensors:
                events.append(f"late reader sees {weights.version} {float(tensors['w'][0, 0])}")

        async with anyio.create_task_group() as tg, weights.use(1) as tensors:
            events.append("lease held")
            tg.start_soon(writer)
            await anyio.sleep(0.02)
            tg.start_soon(late_reader)  # arrives while the update waits: must not starve it
            await anyio.sleep(0.02)
            assert weights.statistics().readers == 1 and weights.statistics().waiting_readers == 1
            events.append(f"still {weights.version} {float(tensors['w'][0, 0])}")

    anyio.run(main)
    assert events == ["lease held", "still 1 0.0", "update starts", "update done", "late reader sees 2 2.0"]


def test_publish_and_release_rules() -> None:
    weights = _weights()

    async def main() -> None:
        with pytest.raises(RuntimeError, match="inside"):
            weights.publish(1)
        with pytest.raises(WeightsUnavailableError):
            _ = weights.tensors
        async with weights.update() as tensors:
            tensors["b"].fill_(5.0)
            weights.publish(4)
        async with weights.update():
            with pytest.raises(VersionError, match="does not follow"):
                weights.publish(4)
            weights.release()
        assert weights.version is None and weights.statistics().allocated_bytes == 0
        with pytest.raises(WeightsUnavailableError):
            _ = weights.tensors
        with anyio.move_on_after(0.05) as scope:
            async with weights.use(0):
                pass
        assert scope.cancelled_caught  # nothing published: generation waits
        async with weights.update() as tensors:
            assert float(tensors["b"].abs().sum()) == 0.0  # re-allocated as zeros
            weights.publish(5)
        assert weights.statistics().updates == 2 and weights.statistics().allocated_bytes == 9 * 4

    anyio.run(main)


def test_single_rank_engine_trains_and_swaps() -> None:
    config = tiny_config()
    spec = ModelShardingSpec.from_config(config)
    groups = TrainGroups(TrainLayout(1), 0, None, None, None)
    engine = ShardedTrainEngine(build_model(config), spec, groups)
    batch = {"input_ids": batches(config, steps=1, rows=2)[0]}
    first = engine.train_step(batch, lm_loss)
    report = engine.offload_state()
    assert engine.state_on_host and report.direction == "to_host" and not report.pinned
    with pytest.raises(TrainStateOffloadedError, match="to_training"):
        engine.train_step(batch, lm_loss)
    with pytest.raises(SwapStateError):
        engine.offload_state()
    engine.reload_state()
    with pytest.raises(SwapStateError):
        engine.reload_state()
    second = engine.train_step(batch, lm_loss)
    assert second < first  # the same batch again, after a step on it
    full = engine.full_state_dict()
    assert set(full) == set(spec.names) and full["lm_head.weight"].shape == (16, 64)
