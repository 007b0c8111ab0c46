"""A consumer process for the dock tests: claims, fetches, acks and records what it acked.

    python dock_worker.py consume ENDPOINT CONSUMER N OUT_JSON [--ack-delay S] [--seed K]
    python dock_worker.py hold ENDPOINT CONSUMER N        # claim, print HELD <indices>, never ack
"""

from __future__ import annotations

import argparse
import json
import random
import sys

import anyio

from streamrl.dock.client import DockClient


async def consume(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    acked: list[int] = []
    async with DockClient(args.endpoint, lease_ttl_s=args.ttl) as dock:
        async for batch in dock.stream(args.consumer, ["x"], args.n, idle_timeout=60):
            for i, t in zip(batch.indices, batch.columns["x"], strict=True):
                assert int(t[0]) == i, f"sample {i} carries data of sample {int(t[0])}"
            if args.ack_delay:
                await anyio.sleep(rng.uniform(0, args.ack_delay))
            await dock.ack(batch.lease)
            acked.extend(batch.indices)
    with open(args.out, "w") as f:
        json.dump(acked, f)


async def hold(args: argparse.Namespace) -> None:
    async with DockClient(args.endpoint, lease_ttl_s=args.ttl) as dock:
        lease = await dock.claim(args.consumer, ["x"], args.n, min_n=args.n, timeout=30)
        print("HELD " + " ".join(map(str, lease.indices)), flush=True)
        await anyio.sleep(3600)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["consume", "hold"])
    ap.add_argument("endpoint")
    ap.add_argument("consumer")
    ap.add_argument("n", type=int)
    ap.add_argument("out", nargs="?")
    ap.add_argument("--ack-delay", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ttl", type=float, default=1.0)
    args = ap.parse_args()
    anyio.run(consume if args.mode == "consume" else hold, args)


if __name__ == "__main__":
    sys.exit(main())
