"""Disaggregated reshard on a real 6-process gloo world: train ranks send, generation workers receive.

Cases (R train ranks + T x replicas generation workers = 6): R=2 -> T=4 (R divides T),
R=4 -> T=2 (T divides R), R=2 -> T=2 x 2 replicas. Version 1 is checked bitwise against the
oracle and by TP logits; version 2 (after a sharded optimizer step) arrives while a generation
lease on version 1 is held, must not disturb it, and then matches an unsharded reference step.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.reshard import reshard_workers as workers
from tests.reshard.reshard_harness import run_world

CASES = [(2, 4, 1), (4, 2, 1), (2, 2, 2)]
BUCKET_BYTES = 40_000


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_world(workers.disaggregated_world, 6, CASES, BUCKET_BYTES, timeout_s=150)


def _by_role(results: list[dict[str, Any]], role: str) -> list[tuple[str, dict[str, Any]]]:
    return [(key, r[key]) for r in results for key in r if r[key]["role"] == role]


def test_roles_follow_the_topology(results: list[dict[str, Any]]) -> None:
    for R, T, replicas in CASES:
        key = f"R{R}-T{T}x{replicas}"
        roles = [r[key]["role"] for r in results]
        assert roles == ["train"] * R + ["generate"] * (T * replicas)
        ranks = [r[key]["v1"]["inference_rank"] for r in results if r[key]["role"] == "generate"]
        assert ranks == list(range(T)) * replicas


def test_generation_workers_receive_their_exact_slices(results: list[dict[str, Any]]) -> None:
    for key, record in _by_role(results, "generate"):
        assert record["v1"]["names_diff"] == [] and record["v1"]["mismatched"] == [], (key, record["v1"])
        assert record["v1"]["logits_max_diff"] < 1e-5, key


def test_new_version_waits_for_the_lease_then_matches_a_reference_step(results: list[dict[str, Any]]) -> None:
    for key, record in _by_role(results, "generate"):
        assert record["held_version"] == 1 and record["held_unchanged"], key
        assert record["v2"]["logits_max_diff"] < 1e-4, (key, record["v2"])
        assert record["v2_report"]["version"] == 2
        assert record["after_close"] is None and record["closed"]


def test_sender_and_receiver_accounting(results: list[dict[str, Any]]) -> None:
    for key, record in _by_role(results, "train"):
        v1 = record["v1"]
        # gathered bucket + one staging buffer (at most one bucket's slice for one worker)
        assert v1["peak_extra_bytes"] <= v1["largest_bucket_bytes"] + v1["staging"], key
        assert v1["largest_bucket_bytes"] <= BUCKET_BYTES
        assert v1["buckets"] >= 5
    for key, record in _by_role(results, "generate"):
        v1 = record["v1_report"]
        assert v1["peak_extra_bytes"] <= BUCKET_BYTES, key
        assert v1["bytes_moved"] == v1["sliced_bytes"] > 0
    # every byte a worker received was sent by a train rank
    for R, T, replicas in CASES:
        key = f"R{R}-T{T}x{replicas}"
        received = sum(r[key]["v1_report"]["received_bytes"] for r in results if r[key]["role"] == "generate")
        sent = sum(r[key]["v1"]["sent_bytes"] for r in results if r[key]["role"] == "train")
        assert sent == received > 0, key
