"""The spawned gloo worlds of the reshard tests: each runs once per pytest process, and every test
module that checks it shares the result (process start-up dominates the cost on 2 cores).

Colocated: one world per train layout, the FSDP2 engine over all of it. Disaggregated: one world
of 6 ranks running every case in turn (R train ranks + T x replicas generation workers = 6).
"""

from __future__ import annotations

import functools
import tempfile
from typing import Any

from tests.reshard import reshard_workers as workers
from tests.reshard.reshard_harness import run_world

BUCKET_BYTES = 40_000  # above the largest gathered parameter (32 KiB), ~8x below the model (305 KiB)

# name: (R, train tensor_parallel, inference T values, vocab size). FSDP x TP 2x2 (mesh
# build_mesh("cpu", 2)) and FSDP dp 2 only. T = 4 with R = 2 is disaggregated-only (colocated needs
# T to divide R). Vocab 17 at R = 2 makes FSDP2's embedding and lm_head shards uneven (9 and 8
# rows: rank 1's to_local() is shorter than the padded layout) and pads the vocab for T = 2; train
# TP must divide the vocab, so the 2x2 world keeps 16.
COLOCATED_WORLDS: dict[str, tuple[int, int, list[int], int]] = {
    "R4-P2": (4, 2, [1, 2, 4], 16),
    "R2-P1": (2, 1, [1, 2], 17),
}

ODD_STAGING_BYTES = 390  # 97 fp32 elements (2 bytes of the cap unused)
# (R, T, replicas[, staging_bytes]); the last is FSDP2's send path at T = 1 (each of the 4
# generation workers holds the whole model)
DISAGGREGATED_CASES: list[tuple[int, ...]] = [
    (2, 4, 1),
    (4, 2, 1),
    (2, 2, 2),
    (4, 2, 1, ODD_STAGING_BYTES),
    (2, 1, 4),
]


@functools.cache
def colocated(name: str) -> list[dict[str, Any]]:
    """Results by rank of the colocated world ``name`` (see :func:`workers.colocated_world`)."""
    R, P, tps, vocab = COLOCATED_WORLDS[name]
    return run_world(workers.colocated_world, R, P, tps, BUCKET_BYTES, vocab, timeout_s=150)


@functools.cache
def disaggregated() -> list[dict[str, Any]]:
    """Results by rank of the 6-rank disaggregated world (see :func:`workers.disaggregated_world`)."""
    with tempfile.TemporaryDirectory(prefix="streamrl-reshard-oracle-") as out_dir:
        return run_world(
            workers.disaggregated_world, 6, DISAGGREGATED_CASES, BUCKET_BYTES, out_dir, timeout_s=150
        )
