"""The launcher-served torch.distributed store of runs across hosts (streamrl/runtime/rendezvous.py):
a world and its subgroups form through it, and it listens on the one address it was given."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import subprocess
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from streamrl.runtime import rendezvous as rv

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def server() -> Iterator[rv.RendezvousServer]:
    s = rv.RendezvousServer("127.0.0.1", timeout_s=30)
    yield s
    s.close()


def _rank(endpoint: str, rank: int, out: mp.Queue) -> None:
    store = rv.connect_store(endpoint, "train", timeout_s=30)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=3, timeout=datetime.timedelta(seconds=30))
    t = torch.full((2,), float(rank + 1))
    dist.all_reduce(t)
    pair = dist.new_group([0, 1])  # torch clones the store for a group (what a Python Store cannot do)
    u = torch.full((2,), float(rank + 1))
    if rank < 2:
        dist.all_reduce(u, group=pair)
    dist.barrier()
    out.put((rank, t.tolist(), u.tolist()))
    dist.destroy_process_group()


def test_a_gloo_world_and_its_subgroups_form_through_the_store(server: rv.RendezvousServer) -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(server.endpoint, r, out)) for r in range(3)]
    for p in procs:
        p.start()
    try:
        results = sorted(out.get(timeout=90) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert results == [(0, [6.0, 6.0], [3.0, 3.0]), (1, [6.0, 6.0], [3.0, 3.0]), (2, [6.0, 6.0], [3.0, 3.0])]
    assert [p.exitcode for p in procs] == [0, 0, 0]
    # worlds are kept apart by their prefix
    assert server.store.check(["train/0"]) or server.store.num_keys() > 0


def test_the_store_listens_on_its_address_only(server: rv.RendezvousServer) -> None:
    listening = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True, timeout=10).stdout.split("\n")
    mine = [line for line in listening if line.split() and line.split()[3].endswith(f":{server.port}")]
    assert mine and all(line.split()[3] == f"127.0.0.1:{server.port}" for line in mine), mine


def test_a_bad_endpoint_is_named() -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        rv.connect_store("tcp://nowhere", "train", timeout_s=1)
