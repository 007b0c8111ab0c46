"""The trainer's checkpoint gate on the control channel, over real sockets: a step reported with
``record`` is answered (``Recorded``) only once the launcher says so, also when the run's Stop
comes first (then the waiting trainer reads the socket itself), and a Stop with no answer, or a
launcher that is gone, ends the wait with False."""

from __future__ import annotations

import anyio
import pytest

from streamrl.runtime import control as c

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

TOKEN = c.new_token()


async def _next(server: c.ControlServer) -> c.WorkerEvent | None:
    with anyio.fail_after(5):
        return await server.recv()


async def test_recorded_is_awaited_also_across_the_runs_stop() -> None:
    server = c.ControlServer("tcp://127.0.0.1:0", token=TOKEN)
    client = c.ControlClient(server.endpoint, "train", 0, token=TOKEN)
    try:
        assert isinstance(await _next(server), c.Starting)
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.wait_stop)  # the worker's stop watch reads the commands
            client.step(3, {"loss": 1.0}, record=True)
            event = await _next(server)
            assert isinstance(event, c.StepReport) and event.step == 3 and event.record
            with anyio.move_on_after(0.3) as unanswered:
                await client.wait_recorded(3, 5)
            assert unanswered.cancelled_caught  # no answer yet: no commit
            await server.broadcast(c.Recorded(3))
            assert await client.wait_recorded(3, 5)

            # the run's end: another rank's stop request made the launcher send Stop before it
            # recorded this step; the stop watch ends with the Stop, the wait reads on by itself
            client.step(4, {"loss": 1.0}, record=True)
            assert isinstance(await _next(server), c.StepReport)
            await server.broadcast(c.Stop("completed 4 steps"))
            await anyio.sleep(0.2)
            await server.broadcast(c.Recorded(4))
            with anyio.fail_after(5):
                assert await client.wait_recorded(4, 60)
        assert client.stop_reason == "completed 4 steps"

        # stopped, and the launcher records no more: False within after_stop_s, not the timeout
        client.step(5, {"loss": 1.0}, record=True)
        with anyio.fail_after(5):
            assert not await client.wait_recorded(5, 60, after_stop_s=0.5)
        client.abandon()  # the launcher is gone: at once
        with anyio.fail_after(1):
            assert not await client.wait_recorded(6, 60)
    finally:
        client.close()
        server.close()
