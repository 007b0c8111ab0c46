"""The launcher-served torch.distributed store of runs across hosts (streamrl/runtime/rendezvous.py)."""

from __future__ import annotations

import datetime
import multiprocessing as mp
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import zmq

from streamrl.curve import RunKeys
from streamrl.runtime import rendezvous as rv


@pytest.fixture
def keys() -> RunKeys:
    return RunKeys.generate()


@pytest.fixture
def server(keys: RunKeys) -> Iterator[rv.RendezvousServer]:
    s = rv.RendezvousServer("tcp://127.0.0.1:0", curve=keys)
    yield s
    s.close()


def _rank(endpoint: str, keys_json: str, rank: int, out: mp.Queue) -> None:
    keys = RunKeys.from_env({"STREAMRL_CURVE_KEYS": keys_json})
    store = rv.RendezvousStore(endpoint, "train", curve=keys, timeout_s=30)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    out.put((rank, t.tolist()))
    dist.destroy_process_group()
    store.close()


def test_a_gloo_world_forms_through_the_store(server: rv.RendezvousServer, keys: RunKeys) -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(server.endpoint, keys.to_env(), r, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = sorted(out.get(timeout=90) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert results == [(0, [3.0] * 4), (1, [3.0] * 4)]
    assert [p.exitcode for p in procs] == [0, 0]
    assert any(k.startswith("train/") for k in server.data)


def test_store_operations(server: rv.RendezvousServer, keys: RunKeys) -> None:
    store = rv.RendezvousStore(server.endpoint, "w", curve=keys, timeout_s=1)
    try:
        store.set("a", b"x")
        assert store.get("a") == b"x"
        assert store.add("n", 2) == 2 and store.add("n", 3) == 5
        assert store.compare_set("c", b"", b"1") == b"1"
        assert store.compare_set("c", b"0", b"2") == b"1"  # expected did not match: current value back
        assert store.check(["a", "n"]) and not store.check(["a", "missing"])
        assert store.num_keys() == 3
        assert store.delete_key("a") and not store.delete_key("a")
        with pytest.raises(rv.RendezvousError, match="did not appear within"):
            store.wait(["never"], datetime.timedelta(seconds=0.2))
    finally:
        store.close()


def test_a_stranger_is_refused_and_garbage_is_answered(server: rv.RendezvousServer, keys: RunKeys) -> None:
    other = RunKeys.generate()
    # knows the server's public key (it is no secret), not the run's client key pair
    knows_server = RunKeys(keys.server_public, other.server_secret, other.client_public, other.client_secret)
    stranger = rv.RendezvousStore(server.endpoint, "train", curve=knows_server, request_timeout_s=1)
    plain = rv.RendezvousStore(server.endpoint, "train", curve=None, request_timeout_s=1)
    try:
        for who in (stranger, plain):
            with pytest.raises(rv.RendezvousError, match="did not answer"):
                who.set("rank0", b"evil")
        assert "train/rank0" not in server.data
        assert server.allow_list is not None and server.allow_list.refused >= 1
    finally:
        stranger.close()
        plain.close()
    # an insider's undecodable bytes get an error reply; the server goes on serving
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.curve_secretkey, sock.curve_publickey = keys.client_secret.encode(), keys.client_public.encode()
    sock.curve_serverkey = keys.server_public.encode()
    sock.connect(server.endpoint)
    try:
        sock.send(b"\xc1garbage")
        assert sock.poll(5000)
        reply = rv._reply_decoder.decode(sock.recv())
        assert isinstance(reply, rv.Error)
        sock.send(rv._encoder.encode(rv.Set(1, "k" * (rv.MAX_KEY_BYTES + 1), b"")))
        assert sock.poll(5000) and isinstance(rv._reply_decoder.decode(sock.recv()), rv.Error)
    finally:
        sock.close(linger=0)
        ctx.term()
    good = rv.RendezvousStore(server.endpoint, "x", curve=keys, timeout_s=2)
    try:
        good.set("k", b"v")
        assert good.get("k") == b"v"
    finally:
        good.close()
