"""A process that records trace spans like a stage worker: ``python -m tests.metrics.trace_worker
RUN_DIR STAGE WORKER N [WAIT_FOR] [DONE_FILE] [FOREVER]``. It records N nested spans (a batch holding
a dock put), waits for the file WAIT_FOR first when given, touches DONE_FILE when done, and with
FOREVER keeps recording until killed."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from streamrl.metrics.trace import open_tracer, tracer, use_tracer


def main(argv: list[str]) -> None:
    run_dir, stage, worker, n = Path(argv[0]), argv[1], int(argv[2]), int(argv[3])
    wait_for = Path(argv[4]) if len(argv) > 4 and argv[4] != "-" else None
    done = Path(argv[5]) if len(argv) > 5 and argv[5] != "-" else None
    forever = len(argv) > 6
    deadline = time.monotonic() + 30
    while wait_for is not None and not wait_for.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"{wait_for} never appeared")
        time.sleep(0.005)
    use_tracer(open_tracer(run_dir, stage, worker, workers=2, stages=["source", "generate", "train"]))
    k = 0
    while k < n or forever:
        with tracer().span("process", "batch", "batch", samples=8) as args:
            with tracer().span("put", "dock_out", "dock", samples=8):
                time.sleep(0.001)
            args["version"] = k
        tracer().counter("policy version", k)
        k += 1
        if k == n and done is not None:
            done.touch()
    tracer().close()


if __name__ == "__main__":
    main(sys.argv[1:])
