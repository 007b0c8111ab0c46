"""Versioned inference weights (shared leases, exclusive updates), and the FSDP2 engine at R = 1 (offload /
reload, reshard of its shards), in one process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
import torch
import torch.distributed as dist

from streamrl.engines.fsdp import FSDPTrainEngine, StateOffloadedError
from streamrl.engines.parallel import build_mesh
from streamrl.engines.samples import TrainSample
from streamrl.reshard import (
    InferenceWeights,
    ReshardConfig,
    Resharder,
    Topology,
    TrainLayout,
    VersionError,
    WeightsUnavailableError,
    build_rank_groups,
)
from tests.reshard.reshard_harness import tiny_config
from tests.reshard.reshard_workers import (
    expected_slice,
    fsdp2_spec,
    full_tensors,
    grpo_steps,
    make_engine,
    train_step,
)

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


@pytest.fixture
def world_of_one(tmp_path: Path) -> Iterator[None]:
    """torch.distributed as a gloo world of 1 in this process (what FSDPTrainEngine needs at R = 1),
    destroyed at the end whatever the test did."""
    if dist.is_initialized():
        raise RuntimeError("a default process group is already initialised in this pytest process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _objective(engine: FSDPTrainEngine, samples: list[TrainSample]) -> float:
    """Sum of advantage x response logprob: what a GRPO step on these samples increases."""
    logprobs = engine.logprobs([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    return sum(s.advantage * float(lp.sum()) for s, lp in zip(samples, logprobs, strict=True))


@pytest.mark.parametrize("wrapped", [False, True], ids=["unwrapped", "fsdp2"])
def test_single_rank_engine_trains_swaps_and_reshards(world_of_one: None, wrapped: bool) -> None:
    """The one-rank engine, unwrapped (its default) and FSDP2-wrapped (``wrap_single_rank``)."""
    config = tiny_config()
    engine = make_engine(config, build_mesh("cpu", 1), wrap_single_rank=wrapped)
    assert engine.wrapped == wrapped
    samples = grpo_steps(config, steps=1)[0]
    before = _objective(engine, samples)
    train_step(engine, samples)
    report = engine.offload_state()
    assert engine.state_on_host and report.direction == "to_host" and not report.pinned
    assert report.bytes == 0  # CPU: the state already lives in host memory, nothing moves
    with pytest.raises(StateOffloadedError, match="reload_state"):
        train_step(engine, samples)
    with pytest.raises(StateOffloadedError, match="reload_state"):
        engine.local_shards()
    with pytest.raises(StateOffloadedError):
        engine.offload_state()
    assert engine.reload_state().direction == "to_device"
    with pytest.raises(StateOffloadedError):
        engine.reload_state()
    train_step(engine, samples)

    # R = 1: the reshard of the (whole) shards is the oracle of full_tensor(), bitwise
    spec, layout = fsdp2_spec(engine)
    assert layout == TrainLayout(1, 1)
    groups = build_rank_groups(Topology.colocated(layout, 1))
    resharder = Resharder(spec, groups, config=ReshardConfig(bucket_bytes=40_000))
    out = {n: torch.zeros(shape) for n, shape in resharder.inference_shapes().items()}
    reshard = resharder.reshard_local(engine.local_shards(), out, version=1)
    full = full_tensors(engine)
    expected = expected_slice(full, config, 1, 0)
    assert out.keys() == expected.keys()
    assert [n for n in expected if not torch.equal(out[n], expected[n])] == []
    assert len(reshard.buckets) >= 5 and reshard.peak_extra_bytes <= reshard.largest_bucket_bytes <= 40_000
    state = engine.full_state_dict()
    assert set(state) == set(spec.names) and state["lm_head.weight"].shape == (16, 64)
    # last: a no-grad forward leaves the root's parameters unsharded (dp = 1: all of them) until
    # the next backward, and the reshard above needs them sharded
    assert _objective(engine, samples) > before  # two steps on these samples raised their objective
