"""The launcher's control channel and the trainer's policy channel with the run's CURVE keys
(``resources.launch: ray`` binds them beyond loopback): the run's processes talk, a stranger —
without keys, or with keys of its own that know the server's public key — gets nothing through."""

from __future__ import annotations

import anyio
import pytest
import torch
import zmq.asyncio

from streamrl.curve import RunKeys
from streamrl.runtime import control as c
from streamrl.runtime.policy import PolicyPublisher, PolicySubscriber, PolicyTimeout

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


def _strangers(keys: RunKeys) -> list[RunKeys | None]:
    other = RunKeys.generate()
    # the server's public key is no secret; the run's client key pair is
    return [None, other, RunKeys(keys.server_public, other.server_secret, other.client_public, other.client_secret)]


async def _next_event(server: c.ControlServer, timeout_s: float) -> c.WorkerEvent | None:
    with anyio.move_on_after(timeout_s):
        while True:
            event = await server.recv()
            if event is not None:
                return event
    return None


async def test_control_channel_takes_only_the_runs_workers() -> None:
    keys = RunKeys.generate()
    ctx = zmq.asyncio.Context()
    server = c.ControlServer("tcp://127.0.0.1:0", ctx, token="t0k", workers={("generate", 0)}, curve=keys)
    clients: list[c.ControlClient] = []
    try:
        for stranger in _strangers(keys):
            # right token, right worker name: still refused, the handshake never completes
            clients.append(c.ControlClient(server.endpoint, "generate", 0, ctx, token="t0k", curve=stranger))
            clients[-1].ready()
            assert await _next_event(server, 1.0) is None
        assert server.allow_list is not None and server.allow_list.refused >= 1
        insider = c.ControlClient(server.endpoint, "generate", 0, ctx, token="t0k", curve=keys)
        clients.append(insider)
        assert isinstance(await _next_event(server, 10.0), c.Starting)
        insider.ready()
        assert isinstance(await _next_event(server, 10.0), c.Ready)
        await server.broadcast(c.Go())
        assert await insider.wait_go(10.0)
    finally:
        for client in clients:
            client.close()
        server.close()
        from streamrl.curve import release_context

        release_context(ctx)
        ctx.term()


async def test_policy_channel_serves_only_the_runs_processes() -> None:
    keys = RunKeys.generate()
    ctx = zmq.asyncio.Context()
    publisher = PolicyPublisher("tcp://127.0.0.1:0", ctx, curve=keys)
    subscribers: list[PolicySubscriber] = []
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(publisher.serve)
            await publisher.publish(1, {"w": torch.arange(4.0)})
            for stranger in _strangers(keys):
                sub = PolicySubscriber(publisher.endpoint, ctx, curve=stranger)
                subscribers.append(sub)
                with pytest.raises(PolicyTimeout):
                    await sub._ask(0, 1, True, 0.0, reply_timeout_s=1.0)
            assert publisher.allow_list is not None and publisher.allow_list.refused >= 1
            assert publisher.bytes_sent == 0
            insider = PolicySubscriber(publisher.endpoint, ctx, curve=keys)
            subscribers.append(insider)
            version, state = await insider.fetch(0, 1, timeout_s=10)
            assert version == 1 and state is not None and torch.equal(state["w"], torch.arange(4.0))
            tg.cancel_scope.cancel()
    finally:
        for sub in subscribers:
            sub.close()
        publisher.close()
        from streamrl.curve import release_context

        release_context(ctx)
        ctx.term()
