"""The launcher's control channel and the trainer's policy channel with the run's credentials,
both mechanisms (every launch mode secures them): the run's processes talk, and the server sees
each one's role; a stranger — no credentials, a wrong password, a key pair that is not the role's,
another run's credentials — gets nothing through."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch
import zmq.asyncio

from streamrl.runtime import control as c
from streamrl.runtime.policy import PolicyPublisher, PolicySubscriber, PolicyTimeout
from streamrl.security import ClientAuth, RunCredentials, release_context, stage_role

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]
GEN = stage_role("generate")


def _strangers(creds: RunCredentials) -> list[ClientAuth | None]:
    other = RunCredentials.generate(creds.mechanism, [GEN])
    if creds.mechanism == "plain":
        forged = ClientAuth("plain", GEN, password="guess")
    else:  # the server's public key is no secret; the role's key pair is
        mine = other.client(GEN)
        forged = ClientAuth("curve", GEN, public=mine.public, secret=mine.secret, server_public=creds.server_public)
    return [None, other.client(GEN), forged]


async def _next_event(server: c.ControlServer, timeout_s: float) -> c.WorkerEvent | None:
    with anyio.move_on_after(timeout_s):
        while True:
            event = await server.recv()
            if event is not None:
                return event
    return None


@pytest.mark.parametrize("mechanism", ["plain", "curve"])
async def test_control_channel_takes_only_the_runs_workers(mechanism: str) -> None:
    creds = RunCredentials.generate(mechanism, [GEN])  # type: ignore[arg-type]
    ctx = zmq.asyncio.Context()
    server = c.ControlServer("tcp://127.0.0.1:0", ctx, token="t0k", workers={("generate", 0)},
                             auth=creds.server())
    clients: list[c.ControlClient] = []
    try:
        for stranger in _strangers(creds):
            # right token, right worker name: still refused, the handshake never completes
            clients.append(c.ControlClient(server.endpoint, "generate", 0, ctx, token="t0k", auth=stranger))
            clients[-1].ready()
            assert await _next_event(server, 1.0) is None
        assert server.allow_list is not None and server.allow_list.refused >= 1
        insider = c.ControlClient(server.endpoint, "generate", 0, ctx, token="t0k", auth=creds.client(GEN))
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
        release_context(ctx)
        ctx.term()


@pytest.mark.parametrize("mechanism", ["plain", "curve"])
async def test_policy_channel_serves_only_the_runs_processes(mechanism: str) -> None:
    creds = RunCredentials.generate(mechanism, [GEN])  # type: ignore[arg-type]
    ctx = zmq.asyncio.Context()
    publisher = PolicyPublisher("tcp://127.0.0.1:0", ctx, auth=creds.server())
    subscribers: list[PolicySubscriber] = []
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(publisher.serve)
            await publisher.publish(1, {"w": torch.arange(4.0)})
            for stranger in _strangers(creds):
                sub = PolicySubscriber(publisher.endpoint, ctx, auth=stranger)
                subscribers.append(sub)
                # twice: the second ask comes after the refused handshake, when a PLAIN stranger's
                # DEALER has no peer left and its send alone would wait forever
                for _ in range(2):
                    with pytest.raises(PolicyTimeout):
                        await sub._ask(0, 1, True, 0.0, reply_timeout_s=1.0)
            assert publisher.allow_list is not None and publisher.allow_list.refused >= 1
            assert publisher.bytes_sent == 0
            insider = PolicySubscriber(publisher.endpoint, ctx, auth=creds.client(GEN))
            subscribers.append(insider)
            version, state = await insider.fetch(0, 1, timeout_s=10)
            assert version == 1 and state is not None and torch.equal(state["w"], torch.arange(4.0))
            tg.cancel_scope.cancel()
    finally:
        for sub in subscribers:
            sub.close()
        publisher.close()
        release_context(ctx)
        ctx.term()


@pytest.mark.parametrize(("launch", "encryption", "mechanism"), [
    ("processes", "auto", "plain"), ("inprocess", "auto", "plain"), ("ray", "auto", "curve"),
    ("processes", "curve", "curve"), ("ray", "off", "plain"),
])
async def test_every_launch_mode_makes_credentials(launch: str, encryption: str, mechanism: str) -> None:
    from streamrl.config import load_config
    from streamrl.runtime.launch_backends import LaunchBackend

    cfg = load_config({"resources": {"launch": launch, "encryption": encryption}})
    assert LaunchBackend.mechanism(cfg) == mechanism


async def test_a_real_processes_dock_refuses_strangers(tmp_path: Path) -> None:
    """The dock the `processes` backend starts (its real launch path) admits each stage's role and
    the launcher's, and refuses a stranger at the handshake."""
    from streamrl.config import load_config
    from streamrl.dock.client import DockClient
    from streamrl.dock.errors import DockTimeout
    from streamrl.dock.limits import DockLimits
    from streamrl.metrics.progress import Progress
    from streamrl.runtime.launch_backends import LocalProcesses
    from streamrl.runtime.prerun import load_pipeline
    from streamrl.security import LAUNCHER

    cfg = load_config({"resources": {"launch": "processes"}})
    pipeline = load_pipeline(cfg)
    backend = LocalProcesses(cfg, pipeline, tmp_path, Progress(1, "none"), str(tmp_path), str(tmp_path))
    assert backend.auth.mechanism == "plain"
    assert set(backend.auth.roles) == {LAUNCHER, "dock", *(stage_role(s.name) for s in pipeline.stages)}
    dock = await anyio.to_thread.run_sync(backend.start_dock, {}, DockLimits())
    try:
        for role in (LAUNCHER, stage_role(pipeline.stages[0].name)):
            async with DockClient(dock.controller_endpoint, auth=backend.auth.client(role), connect_timeout_s=20,
                                  request_timeout_s=10) as client:
                stats = await client.server_statistics()
        for stranger in (None, ClientAuth("plain", LAUNCHER, password="guess")):
            with pytest.raises(DockTimeout):
                async with DockClient(dock.controller_endpoint, auth=stranger, connect_timeout_s=1.0,
                                      request_timeout_s=1.0):
                    pass
        async with DockClient(dock.controller_endpoint, auth=backend.auth.client(LAUNCHER)) as client:
            after = await client.server_statistics()
        assert after["controller"]["auth"]["refused"] > stats["controller"]["auth"]["refused"]
    finally:
        await anyio.to_thread.run_sync(backend.close)
