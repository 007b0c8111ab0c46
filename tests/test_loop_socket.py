"""LoopSocket against real ZeroMQ sockets over ipc in a temp dir: delivery, order, the send queue, recv."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import anyio
import pytest
import zmq
import zmq.asyncio

from streamrl.loop_socket import MAX_MESSAGES_PER_TURN, LoopSocket

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _pair(tmp_path: Path, **dealer_opts: int) -> tuple[zmq.Context, zmq.Socket, zmq.Socket, str]:
    ctx = zmq.Context()
    address = f"ipc://{tmp_path}/s"
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    router.bind(address)
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    for opt, value in dealer_opts.items():
        dealer.setsockopt(getattr(zmq, opt), value)
    dealer.connect(address)
    return ctx, router, dealer, address


@contextlib.asynccontextmanager
async def _greeted(tmp_path: Path, on_message=None, copy: bool = False):  # type: ignore[no-untyped-def]
    """A LoopSocket DEALER that said hello to a ROUTER: (link, router, the dealer's identity there)."""
    ctx, router, dealer, _ = _pair(tmp_path)
    link = LoopSocket(dealer, on_message, copy=copy)
    try:
        link.send([b"hello"])
        identity, _ = await anyio.to_thread.run_sync(router.recv_multipart)
        yield link, router, identity
    finally:
        link.close()
        router.close()
        ctx.term()


async def _until(cond, what: str, timeout_s: float = 5.0) -> None:
    with anyio.fail_after(timeout_s):
        while not cond():
            await anyio.sleep(0.002)


async def test_every_reply_reaches_the_handler_in_order_also_beyond_one_turns_share(tmp_path: Path) -> None:
    got: list[bytes] = []
    async with _greeted(tmp_path, lambda frames: got.append(frames[0].bytes)) as (link, router, identity):
        n = 3 * MAX_MESSAGES_PER_TURN + 5  # several turns' worth, all queued before the loop looks
        for i in range(n):
            router.send_multipart([identity, str(i).encode()])
        await _until(lambda: len(got) == n, "replies")
        assert got == [str(i).encode() for i in range(n)]
        assert link.messages_received == n and link.messages_sent == 1


async def test_a_reply_whose_signal_a_send_took_is_still_served(tmp_path: Path) -> None:
    """A reply arrives while the loop is busy; the next send takes in libzmq's pending commands, and
    with them the descriptor's signal of that reply: the loop would not wake for it again."""
    ctx, router, dealer, _ = _pair(tmp_path)
    got: list[bytes] = []
    link = LoopSocket(dealer, lambda frames: got.append(frames[0].bytes))
    try:
        await anyio.sleep(0.01)  # the socket joined the loop; nothing to serve yet
        for i in range(20):
            link.send([b"request"])
            # no yield to the loop from here to the next send: the reply lands meanwhile
            identity, _ = router.recv_multipart()
            router.send_multipart([identity, str(i).encode()])
            time.sleep(0.02)  # the reply reaches the dealer's queue (libzmq's I/O thread)
            link.send([b"another request"])  # takes the reply's signal
            router.recv_multipart()
            await _until(lambda n=i + 1: len(got) == n, "the reply", timeout_s=2.0)
        assert got == [str(i).encode() for i in range(20)]
    finally:
        link.close()
        router.close()
        ctx.term()


async def test_sends_the_socket_cannot_take_wait_in_order_until_it_can(tmp_path: Path) -> None:
    ctx = zmq.Context()
    address = f"ipc://{tmp_path}/late"
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.sndhwm = 1
    dealer.setsockopt(zmq.IMMEDIATE, 1)  # no peer yet: libzmq takes nothing, every send is EAGAIN
    dealer.connect(address)
    link = LoopSocket(dealer, lambda frames: None)
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    try:
        for i in range(50):
            link.send([str(i).encode()])
        assert link.queued == 50 and link.messages_sent == 0
        router.bind(address)  # the peer comes: the socket takes messages, the queue drains in order
        got: list[bytes] = []

        def take_all() -> None:
            while len(got) < 50 and router.poll(5000):
                got.append(router.recv_multipart()[1])

        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, take_all)
            await _until(lambda: link.queued == 0, "the queue to drain")
        assert got == [str(i).encode() for i in range(50)]
        assert link.messages_sent == 50
    finally:
        link.close()
        router.close()
        ctx.term()


async def test_recv_takes_messages_only_when_asked_and_in_order(tmp_path: Path) -> None:
    async with _greeted(tmp_path, copy=True) as (link, router, identity):
        for i in range(5):
            router.send_multipart([identity, str(i).encode()])
        await anyio.sleep(0.05)
        assert link.messages_received == 0  # nobody asked: they wait in libzmq's queue (bounded by RCVHWM)
        with anyio.fail_after(5):
            assert [(await link.recv())[0] for _ in range(3)] == [b"0", b"1", b"2"]
            results: list[bytes] = []

            async def one() -> None:
                results.append((await link.recv())[0])

            async with anyio.create_task_group() as tg:  # concurrent receivers: one message each
                for _ in range(4):
                    tg.start_soon(one)
                await anyio.sleep(0.05)
                router.send_multipart([identity, b"5"])
                router.send_multipart([identity, b"6"])
        assert sorted(results) == [b"3", b"4", b"5", b"6"]


async def test_a_message_that_came_as_its_recv_was_cancelled_goes_to_the_next_recv(tmp_path: Path) -> None:
    async with _greeted(tmp_path, copy=True) as (link, router, identity):
        task = asyncio.ensure_future(link.recv())
        await asyncio.sleep(0.01)  # the task waits on its Future
        router.send_multipart([identity, b"first"])
        assert link.socket.poll(5000)  # without yielding to the loop: it must not serve the message itself
        link._serve()  # the loop's callback hands it to the waiting Future ...
        task.cancel()  # ... and the task is cancelled before it resumes
        with pytest.raises(asyncio.CancelledError):
            await task
        with anyio.fail_after(5):
            assert await link.recv() == [b"first"]


async def test_a_failing_handler_is_counted_and_the_socket_goes_on(tmp_path: Path) -> None:
    got: list[bytes] = []

    def handler(frames: list[zmq.Frame]) -> None:
        if frames[0].bytes == b"bad":
            raise ValueError("a handler's bug")
        got.append(frames[0].bytes)

    async with _greeted(tmp_path, handler) as (link, router, identity):
        for payload in (b"a", b"bad", b"b"):
            router.send_multipart([identity, payload])
        await _until(lambda: got == [b"a", b"b"], "the good messages")
        assert link.handler_errors == 1


def test_a_socket_made_before_the_loop_runs_joins_the_loop_that_uses_it(tmp_path: Path) -> None:
    ctx, router, dealer, _ = _pair(tmp_path)
    link = LoopSocket(dealer, copy=True)
    link.send([b"sent before any loop ran"])  # a worker's first event, sent from its constructor
    identity, payload = router.recv_multipart()
    assert payload == b"sent before any loop ran"
    router.send_multipart([identity, b"reply"])

    async def main() -> list[bytes]:
        with anyio.fail_after(5):
            return await link.recv()

    try:
        assert anyio.run(main, backend="asyncio") == [b"reply"]
    finally:
        link.close()
        router.close()
        ctx.term()


async def test_close_ends_a_waiting_recv_and_an_asyncio_socket_is_refused(tmp_path: Path) -> None:
    async with _greeted(tmp_path) as (link, _, _):
        errors: list[BaseException] = []

        async def waiter() -> None:
            try:
                await link.recv()
            except zmq.ZMQError as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.sleep(0.02)
            link.close()
        assert link.closed and len(errors) == 1
    actx = zmq.asyncio.Context()
    asock = actx.socket(zmq.DEALER)
    with pytest.raises(TypeError, match=r"plain zmq\.Socket"):
        LoopSocket(asock)
    asock.close()
    actx.term()


async def test_a_capped_receive_keeps_the_first_frames_and_counts_them_all(tmp_path: Path) -> None:
    async with _greeted(tmp_path, copy=True) as (link, router, identity):
        assert link.recv_capped_nowait(2) is None  # nothing here yet
        router.send_multipart([identity, *[b"f%d" % i for i in range(1000)]])  # a flood of small frames
        router.send_multipart([identity, b"next"])
        with anyio.fail_after(5):
            assert await link.recv_capped(2) == ([b"f0", b"f1"], 1000)
            assert await link.recv() == [b"next"]  # the flood's other frames were read and dropped
