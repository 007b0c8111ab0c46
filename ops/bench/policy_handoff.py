"""A policy version from the trainer to a generator on the same host: its shared-memory file against the socket.

Two processes, as in placement ``separate``: the trainer's (a ``PolicyPublisher`` serving
``policy.fetch``) and a generator's (a ``PolicySubscriber`` that waits for each version, then
copies it into its own model, as ``TorchRolloutEngine.load_weights`` does). For each model size,
versions are published one after another, alternating the two ways per repetition:

  socket  the weights as frames over the policy channel's ZeroMQ socket (ipc), the publisher
          serving the gathered copy it was handed (the baseline: how the weights moved before);
  file    the weights written into the version's file in a shared-memory directory, which the
          subscriber maps (streamrl.runtime.policy_file).

Figures, per version, median over the versions of a repetition:
  publish    the trainer's part: the snapshot (the socket way serves a gathered copy the trainer
             made; the file way writes the file, its one copy) and publish() answering the waiter;
  delivered  from the start of the publish until the generator has the weights installed.

The model sizes are tiny Qwen2 models of ops/bench/cost_growth.py (0.4M .. 100M parameters,
fp32). Last line: one JSON object.

    python ops/bench/policy_handoff.py                 # 3 repetitions x 8 versions per size
    python ops/bench/policy_handoff.py --sizes 3M,25M --reps 5
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt_spread, print_json_line, print_table, ratio, spread

SIZES: dict[str, tuple[int, int]] = {"0.4M": (128, 2), "3M": (256, 4), "25M": (512, 8), "100M": (1024, 10)}
ROOT = Path(__file__).resolve().parents[2]


def _state(size: str) -> dict[str, torch.Tensor]:
    from streamrl.models.build import TinyModelSpec, build_model
    from streamrl.models.tokenizer import build_char_tokenizer

    hidden, layers = SIZES[size]
    model = build_model(TinyModelSpec(hidden=hidden, layers=layers, heads=8, intermediate=2 * hidden, seed=0),
                        build_char_tokenizer())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _generator(endpoint: str, shm: str | None, size: str, versions: int, done: Any) -> None:
    """The generator's process: wait for each version, install it into its own model's tensors."""
    from streamrl.runtime.policy import PolicySubscriber

    model = _state(size)

    async def run() -> None:
        sub = PolicySubscriber(endpoint, shm_dir=Path(shm) if shm else None)
        have = 0
        try:
            for v in range(1, versions + 1):
                version, state = await sub.fetch(have, v, timeout_s=120)
                assert state is not None and version == v
                for name, t in state.items():
                    model[name].copy_(t)
                del state
                done.put((v, time.monotonic()))
                have = version
        finally:
            sub.close()

    anyio.run(run)


async def _trainer(size: str, way: str, versions: int) -> dict[str, float]:
    from streamrl.runtime.policy import PolicyPublisher

    live = _state(size)
    with tempfile.TemporaryDirectory() as tmp:
        shm = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else tmp))
        try:
            pub = PolicyPublisher(f"ipc://{tmp}/weights", shm_dir=shm if way == "file" else None)
            ctx = mp.get_context("spawn")
            done = ctx.Queue()
            gen = ctx.Process(target=_generator, args=(pub.endpoint, str(shm) if way == "file" else None, size,
                                                       versions, done))
            gen.start()
            publish_ms, delivered_ms = [], []
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(pub.serve)
                    await anyio.sleep(3.0)  # the generator builds its model and starts waiting
                    for v in range(1, versions + 1):
                        for t in live.values():
                            t.add_(1e-3)  # an optimizer step
                        t0 = time.monotonic()
                        if way == "file":
                            await pub.publish(v, snapshot=pub.snapshot(v, live))
                        else:  # as the trainer did: a gathered copy, served as it is
                            await pub.publish(v, {k: t.clone() for k, t in live.items()}, owned=True)
                        t1 = time.monotonic()
                        got, t_done = await anyio.to_thread.run_sync(done.get, True, 120)
                        assert got == v
                        publish_ms.append((t1 - t0) * 1e3)
                        delivered_ms.append((t_done - t0) * 1e3)
                        await anyio.sleep(0.3)  # a training step: the next version comes later
                    tg.cancel_scope.cancel()
            finally:
                gen.join(timeout=30)
                if gen.is_alive():
                    gen.kill()
                pub.close()
        finally:
            shutil.rmtree(shm, ignore_errors=True)
    # the first version pays the generator's first mapping and the allocator's warm-up
    return {"publish_ms": statistics.median(publish_ms[1:]), "delivered_ms": statistics.median(delivered_ms[1:]),
            "mib": sum(t.numel() * t.element_size() for t in live.values()) / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=",".join(SIZES))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--versions", type=int, default=8, help="versions published per repetition")
    args = ap.parse_args()
    sizes = [s for s in args.sizes.split(",") if s]
    for s in sizes:
        if s not in SIZES:
            raise SystemExit(f"--sizes: unknown size {s!r} (sizes: {', '.join(SIZES)})")
    load0 = os.getloadavg()[0]
    results: dict[str, dict[str, list[float]]] = {}
    mib: dict[str, float] = {}
    for rep in range(args.reps):
        for size in sizes:
            for way in (("socket", "file") if rep % 2 == 0 else ("file", "socket")):
                r = anyio.run(_trainer, size, way, args.versions)
                mib[size] = r["mib"]
                for k in ("publish_ms", "delivered_ms"):
                    results.setdefault(f"{size}/{way}/{k}", []).append(r[k])
                print(f"rep {rep} {size:5s} {way:6s} publish {r['publish_ms']:7.1f} ms  delivered "
                      f"{r['delivered_ms']:7.1f} ms  load {os.getloadavg()[0]:.2f}", flush=True)
    figures: dict[str, Any] = {}
    baseline: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    rows = []
    for size in sizes:
        f = {k: spread(results[f"{size}/file/{k}"]) for k in ("publish_ms", "delivered_ms")}
        b = {k: spread(results[f"{size}/socket/{k}"]) for k in ("publish_ms", "delivered_ms")}
        figures[size], baseline[size] = f, b
        ratios[size] = round(ratio(b["delivered_ms"], f["delivered_ms"]), 2)
        rows.append([size, f"{mib[size]:.1f}", fmt_spread(b["publish_ms"]), fmt_spread(f["publish_ms"]),
                     fmt_spread(b["delivered_ms"]), fmt_spread(f["delivered_ms"]), f"{ratios[size]:.2f}"])
    print()
    print_table(["model", "MiB", "publish socket ms", "publish file ms", "delivered socket ms",
                 "delivered file ms", "speed-up"], rows)
    print(f"load average {load0:.2f} .. {os.getloadavg()[0]:.2f}")
    print_json_line("policy_handoff", figures, baseline, ratios,
                    {"delivered_speedup": ">= 1 at every size (socket time / file time)"})


if __name__ == "__main__":
    main()
