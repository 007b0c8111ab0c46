"""A worker's control link that resets stays registered (issue 25): its events are still taken
and the launcher's Stop still reaches it, through a relay reset between them."""

from __future__ import annotations

import anyio
import pytest

from streamrl.runtime import control as c
from tests.dock.relay import Relay

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


async def test_a_worker_whose_control_link_resets_stays_registered() -> None:
    token = c.new_token()
    server = c.ControlServer("tcp://127.0.0.1:0", token=token, workers={("gen", 0)})
    relay = Relay(server.endpoint)
    client = c.ControlClient(relay.endpoint, "gen", 0, token=token)
    try:
        with anyio.fail_after(10):
            assert isinstance(await server.recv(), c.Starting)
            assert await anyio.to_thread.run_sync(relay.reset) == 1
            while relay.accepted < 2:  # the worker's socket reconnected through the relay
                await anyio.sleep(0.01)
            client.busy(1.0, 1, 8)
            event = await server.recv()  # before: a new routing id, dropped as "unregistered"
            assert isinstance(event, c.StageBusy) and event.samples == 8
            await server.send_to(("gen", 0), c.Stop("done"))
            assert await client.wait_stop() == "done"
        assert server.statistics()["dropped"]["unregistered"] == 0
    finally:
        client.close()
        server.close()
        relay.close()
