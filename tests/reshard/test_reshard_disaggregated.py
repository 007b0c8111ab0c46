"""Disaggregated reshard on a real 6-process gloo world: FSDP2 train ranks send, generation workers receive.

Cases (R train ranks + T x replicas generation workers = 6): R=2 -> T=4 (R divides T),
R=4 -> T=2 (T divides R), R=2 -> T=2 x 2 replicas, with the default staging chunk
(``BUCKET_BYTES // 8``: 1250 fp32 elements), R=4 -> T=2 again with a 390-byte chunk (97
elements, prime), and R=2 -> T=1 x 4 replicas (every worker holds the whole model). Both chunk
sizes are smaller than the largest pieces (so a piece spans several chunks) and are multiples of
no piece's row length (so chunks start and end inside rows); the precondition is checked on the
plan. The train ranks are an FSDP2 engine over a ``(dp,)`` mesh of the train ranks only.
Version 1 (the initial weights) is checked bitwise against the oracle and by TP logits; version 2
(after a GRPO step) arrives while a generation lease on version 1 is held, must not disturb it,
and then matches, bitwise, the oracle of the full weights the train side wrote after its step.
"""

from __future__ import annotations

from typing import Any

import pytest

from streamrl.reshard import ModelShardingSpec, ReshardConfig
from tests.reshard import reshard_worlds as worlds
from tests.reshard.reshard_harness import tiny_config
from tests.reshard.reshard_workers import ITEMSIZE, case_key

CASES = worlds.DISAGGREGATED_CASES
BUCKET_BYTES = worlds.BUCKET_BYTES


def _chunk_bytes(case: tuple[int, ...]) -> int:
    """The staging chunk each side should hold (every destination's slices exceed it here)."""
    staging = case[3] if len(case) > 3 else None
    numel = ReshardConfig(bucket_bytes=BUCKET_BYTES, staging_bytes=staging).staging_numel(ITEMSIZE)
    assert numel is not None
    return numel * ITEMSIZE


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return worlds.disaggregated()


def _by_role(results: list[dict[str, Any]], role: str) -> list[tuple[str, dict[str, Any]]]:
    return [(key, r[key]) for r in results for key in r if r[key]["role"] == role]


def test_roles_follow_the_topology(results: list[dict[str, Any]]) -> None:
    for case in CASES:
        R, T, replicas, *_ = case
        key = case_key(case)
        roles = [r[key]["role"] for r in results]
        assert roles == ["train"] * R + ["generate"] * (T * replicas)
        ranks = [r[key]["v1"]["inference_rank"] for r in results if r[key]["role"] == "generate"]
        assert ranks == list(range(T)) * replicas


def test_generation_workers_receive_their_exact_slices(results: list[dict[str, Any]]) -> None:
    for key, record in _by_role(results, "generate"):
        assert record["v1"]["names_diff"] == [] and record["v1"]["mismatched"] == [], (key, record["v1"])
        assert record["v1"]["logits_max_diff"] < 1e-5, key


def test_new_version_waits_for_the_lease_then_matches_the_trained_weights(
    results: list[dict[str, Any]],
) -> None:
    for key, record in _by_role(results, "generate"):
        assert record["held_version"] == 1 and record["held_unchanged"], key
        assert record["v2"]["names_diff"] == [] and record["v2"]["mismatched"] == [], (key, record["v2"])
        assert record["v2"]["logits_max_diff"] < 1e-5, (key, record["v2"])
        assert record["v2_report"]["version"] == 2
        assert record["after_close"] is None and record["closed"]


def test_the_train_ranks_took_the_same_step(results: list[dict[str, Any]]) -> None:
    for case in CASES:
        key = case_key(case)
        losses = {r[key]["loss"] for r in results if r[key]["role"] == "train"}
        assert len(losses) == 1, (key, losses)


def test_cases_cut_pieces_across_chunks_and_inside_rows() -> None:
    spec = ModelShardingSpec.from_config(tiny_config())
    for case in CASES:
        chunk = _chunk_bytes(case) // ITEMSIZE
        pieces = [p for rank in spec.inference_plan(case[1]).pieces for p in rank]
        assert max(p.numel for p in pieces) > chunk, case  # a piece spans two chunks or more
        rows = {p.shape[-1] for p in pieces if len(p.shape) > 1}
        assert all(chunk % row for row in rows), (case, chunk, rows)


def test_sender_and_receiver_accounting(results: list[dict[str, Any]]) -> None:
    for case in CASES:
        key, chunk = case_key(case), _chunk_bytes(case)
        assert chunk <= BUCKET_BYTES / 4
        for record in (r[key] for r in results if r[key]["role"] == "train"):
            for v in (record["v1"], record["v2"]):
                # one gathered bucket + one staging chunk; a rank with no destination stages nothing
                assert v["staging"] == (chunk if v["sent_bytes"] else 0), key
                assert v["peak_extra_bytes"] <= v["largest_bucket_bytes"] + v["staging"], key
                assert v["largest_bucket_bytes"] <= BUCKET_BYTES
                assert v["buckets"] >= 5
        for record in (r[key] for r in results if r[key]["role"] == "generate"):
            v1 = record["v1_report"]
            assert record["v1_staging"] == chunk and v1["peak_extra_bytes"] <= chunk, key
            assert v1["bytes_moved"] == v1["sliced_bytes"] > 0
        # every byte a worker received was sent by a train rank
        received = sum(r[key]["v1_report"]["received_bytes"] for r in results if r[key]["role"] == "generate")
        sent = sum(r[key]["v1"]["sent_bytes"] for r in results if r[key]["role"] == "train")
        assert sent == received > 0, key
