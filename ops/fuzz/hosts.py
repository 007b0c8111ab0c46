"""Stand-alone processes serving the launcher's two channels, so the fuzzer can hammer them.

In a run, the control channel (``ControlServer``) lives in the launcher and the policy channel
(``PolicyPublisher``) in the trainer. Here each is served alone by the real class, on
``tcp://127.0.0.1:0``, in its own process (so its memory can be read from /proc):

    python -m ops.fuzz.hosts control --token T --workers gen:0,train:0
    python -m ops.fuzz.hosts policy

Each prints ``READY <endpoint>`` and serves until SIGTERM or stdin closes. The control host
answers every accepted ``Ready`` with ``Go`` (what the launcher does once all are ready), so a
client can check it still registers real workers; the policy host publishes version 1 of a small
state dict (``w`` = arange(8), ``b`` = ones(3) in bf16).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

import anyio
import torch

from streamrl.runtime import control as c
from streamrl.runtime.policy import PolicyPublisher

POLICY_STATE = {"w": torch.arange(8, dtype=torch.float32), "b": torch.ones(3, dtype=torch.bfloat16)}


async def _serve_control(token: str, workers: set[tuple[str, int]], stop: anyio.Event) -> None:
    server = c.ControlServer("tcp://127.0.0.1:0", token=token, workers=workers)
    print(f"READY {server.endpoint}", flush=True)
    async with anyio.create_task_group() as tg:

        async def loop() -> None:
            while True:
                event = await server.recv()
                if isinstance(event, c.Ready):
                    await server.broadcast(c.Go())

        tg.start_soon(loop)
        await stop.wait()
        tg.cancel_scope.cancel()
    print(f"STATS {server.statistics()}", flush=True)
    server.close()


async def _serve_policy(stop: anyio.Event) -> None:
    pub = PolicyPublisher("tcp://127.0.0.1:0")
    await pub.publish(1, POLICY_STATE)
    print(f"READY {pub.endpoint}", flush=True)
    async with anyio.create_task_group() as tg:
        tg.start_soon(pub.serve)
        await stop.wait()
        tg.cancel_scope.cancel()
    print(f"STATS dropped={pub.dropped}", flush=True)
    pub.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ops.fuzz.hosts", description=__doc__.splitlines()[0])
    ap.add_argument("channel", choices=["control", "policy"])
    ap.add_argument("--token", default="", help="control: the token Starting must carry")
    ap.add_argument("--workers", default="gen:0", help="control: stage:worker pairs that may register")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    async def serve() -> None:
        stop = anyio.Event()
        token = anyio.lowlevel.current_token()

        def on_stop(*_: object) -> None:
            anyio.from_thread.run_sync(stop.set, token=token)

        signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=on_stop).start())
        # stdin closing (the fuzzer died) also stops the host: no orphan
        threading.Thread(target=lambda: (sys.stdin.read(), on_stop()), daemon=True).start()
        if args.channel == "control":
            pairs = {(s, int(k)) for s, k in (w.split(":") for w in args.workers.split(",") if w)}
            await _serve_control(args.token, pairs, stop)
        else:
            await _serve_policy(stop)

    anyio.run(serve)
    return 0


if __name__ == "__main__":
    sys.exit(main())
