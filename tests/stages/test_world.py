"""Pure helpers of the reshard stages: which device and backend a rank of a reshard world gets.

The accelerator cases cannot run on the CPU-only test machine, so they fake the device *count*
only (``resolve_device`` and ``torch.cuda.device_count``); the mapping is what is under test.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from streamrl.stages import world
from streamrl.stages.world import default_backend, rank_device


def test_cpu_ranks_stay_on_cpu_with_gloo() -> None:
    assert default_backend("cpu") == "gloo"
    assert [rank_device("cpu", r, 4, "gloo") for r in range(4)] == ["cpu"] * 4


def test_accelerator_ranks_spread_over_the_devices_of_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(world, "resolve_device", lambda d: torch.device(d))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert default_backend("cuda") == "nccl"
    assert [rank_device("cuda", r, 4, "nccl") for r in range(4)] == [f"cuda:{r}" for r in range(4)]
    assert rank_device("cuda:2", 0, 4, "nccl") == "cuda:2"  # an explicit index is the user's choice
    # gloo may share devices: 6 ranks wrap around the 4 devices
    assert [rank_device("cuda", r, 6, "gloo") for r in range(6)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3",
                                                                    "cuda:0", "cuda:1"]


def test_more_nccl_ranks_than_devices_is_refused_saying_what_to_change(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(world, "resolve_device", lambda d: torch.device(d))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"2 reshard ranks .* but 1 cuda device\(s\): nccl needs one device per rank"):
        rank_device("cuda", 1, 2, "nccl")


def test_a_join_abandoned_before_its_rendezvous_completes_leaves_no_process_group(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage stopped during set-up abandons its join while the daemon thread still initialises the
    group; the thread must not leave it initialised (an in-process run's next run would find a
    default group already there). The group's initialisation is held until the stage has given up
    (a world of one rank joins at once: on a busy machine the thread won the race and the stage
    then owned the group, which only its close() destroys)."""
    from types import SimpleNamespace

    import anyio
    import torch.distributed as dist

    from streamrl.stages.world import join_world

    assert not dist.is_initialized()
    ctx = SimpleNamespace(run_dir=tmp_path, rendezvous_endpoint=None, spec=SimpleNamespace(name="train"), worker=0,
                          config=SimpleNamespace(resources=SimpleNamespace(start_timeout_s=30.0)))
    given_up = threading.Event()
    init_process_group = dist.init_process_group

    def init_once_given_up(*args: object, **kwargs: object) -> None:
        assert given_up.wait(30), "the join was never abandoned"
        init_process_group(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(world.dist, "init_process_group", init_once_given_up)

    async def main() -> None:
        with anyio.CancelScope() as scope:
            scope.cancel()  # cancelled at its first wait: the thread is still joining
            await join_world(ctx, "train", 0, 1, None, backend="gloo", timeout_s=30.0,  # type: ignore[arg-type]
                             device="cpu")
        given_up.set()
        deadline = time.monotonic() + 30
        while any(t.name == "streamrl-join-world" for t in threading.enumerate()) and time.monotonic() < deadline:
            await anyio.sleep(0.01)

    anyio.run(main)
    assert not dist.is_initialized()
