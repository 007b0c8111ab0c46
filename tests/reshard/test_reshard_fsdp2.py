"""Reshard from FSDP2 shards: bitwise equal to ``full_tensor()``; peak <= one bucket, from the accounting.

Checked on the worlds of ``reshard_worlds`` (shared with test_reshard_colocated.py and
test_reshard_disaggregated.py, so no extra processes are spawned):

- colocated, R = 2 (FSDP dp 2 only; vocab 17, so rank 1's embedding and lm_head ``to_local()``
  shards are a row shorter than rank 0's) and R = 4 (FSDP x TP 2x2, mesh ``build_mesh("cpu",
  2)``), after 3 GRPO steps: for inference T in {1, 2}, ``Resharder.reshard_local`` of
  ``engine.local_shards()`` over ``Topology.colocated(layout, T)``, with the spec and layout from
  ``spec_for_placements``, gives every inference weight of every rank bitwise equal
  (``torch.equal``) to the oracle ``expected_slice`` of ``{name: p.full_tensor()}``; and the
  report's ``peak_extra_bytes`` <= its ``largest_bucket_bytes`` <= ``bucket_bytes`` (40 000 B:
  10-11 buckets for the 305 KB model).
- disaggregated send path, R = 2 FSDP2 train ranks -> T = 1 generation workers (4 replicas: the
  6-rank world's case ``R2-T1x4``): the received weights of version 1 (initial) and version 2
  (after a step) are bitwise equal to the oracle of the train side's ``full_tensor()``; the
  sender's peak <= one bucket + one staging chunk, the receiver's <= one chunk.
"""

from __future__ import annotations

from typing import Any

import pytest

from streamrl.reshard import ReshardConfig
from tests.reshard import reshard_worlds as worlds
from tests.reshard.reshard_workers import ITEMSIZE, case_key

BUCKET_BYTES = worlds.BUCKET_BYTES
COLOCATED_TS = ("1", "2")
SEND_CASE = (2, 1, 4)  # R = 2 train ranks, T = 1, 4 generation workers
World = tuple[str, list[dict[str, Any]]]


@pytest.fixture(scope="module", params=list(worlds.COLOCATED_WORLDS))
def world(request: pytest.FixtureRequest) -> World:
    return request.param, worlds.colocated(request.param)


def _colocated_cases(world: World) -> list[tuple[int, str, dict[str, Any]]]:
    return [(rank, T, r["matrix"]["by_t"][T]) for rank, r in enumerate(world[1]) for T in COLOCATED_TS]


def test_the_spec_follows_the_fsdp2_placements(world: World) -> None:
    name, results = world
    R, P, _, _ = worlds.COLOCATED_WORLDS[name]
    for result in results:
        train = result["matrix"]["train"]
        assert train["layout"] == [R, P]
        dims = train["tp_dims"]
        if P == 1:
            assert set(dims.values()) == {None}
            continue
        for param, dim in dims.items():
            if param.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight",
                               "v_proj.bias", "gate_proj.weight", "up_proj.weight")):
                assert dim == 0, param  # ColwiseParallel
            elif param.endswith(("o_proj.weight", "down_proj.weight")):
                assert dim == 1, param  # RowwiseParallel
            else:  # embeddings and norms: FSDP x TP leaves them replicated over tp
                assert dim is None, param


def test_uneven_fsdp2_shards_are_resharded_unpadded(world: World) -> None:
    name, results = world
    unpadded = [r["matrix"]["train"]["unpadded"] for r in results]
    if name == "R2-P1":  # 17 vocab rows over dp 2: 9 + 8, rank 1's shards are shorter than the layout's
        assert unpadded == [[], ["lm_head.weight", "model.embed_tokens.weight"]]
    else:
        assert unpadded == [[]] * len(results)


def test_colocated_reshard_is_bitwise_equal_to_full_tensor(world: World) -> None:
    seen: dict[str, set[int]] = {}
    for rank, T, case in _colocated_cases(world):
        assert case["names_diff"] == [], (rank, T, case["names_diff"])
        assert case["mismatched"] == [], f"{world[0]} rank {rank}, T={T}: {case['mismatched']}"
        seen.setdefault(T, set()).add(case["inference_rank"])
    assert seen == {T: set(range(int(T))) for T in COLOCATED_TS}


def test_colocated_peak_is_at_most_one_bucket(world: World) -> None:
    for rank, T, case in _colocated_cases(world):
        assert case["buckets"] >= 5, (rank, T, case["buckets"])  # several buckets, one buffer
        assert case["peak_extra_bytes"] <= case["largest_bucket_bytes"], (rank, T, case)
        assert case["peak_extra_bytes"] <= case["bucket_bytes"] == BUCKET_BYTES, (rank, T, case)


def test_colocated_stream_yields_whole_parameters_bitwise_one_bucket_at_a_time(world: World) -> None:
    """``reshard_local_stream`` (what a colocated vLLM engine loads): every parameter whole and
    bitwise equal to ``full_tensor()``, with at most one gathered bucket plus that bucket's
    parameters alive at once."""
    for rank, T, case in _colocated_cases(world):
        if T != "1":
            continue
        assert case["stream_equal"], (world[0], rank)
        assert case["stream_buckets"] == case["buckets"] >= 5, (rank, case)
        assert case["stream_peak_extra_bytes"] <= 2 * case["stream_largest_bucket_bytes"], (rank, case)
        assert case["stream_largest_bucket_bytes"] <= BUCKET_BYTES


@pytest.fixture(scope="module")
def send_case() -> list[dict[str, Any]]:
    key = case_key(SEND_CASE)
    return [r[key] for r in worlds.disaggregated()]


def test_disaggregated_send_from_fsdp2_is_bitwise_equal_to_full_tensor(send_case: list[dict[str, Any]]) -> None:
    R, T, replicas = SEND_CASE
    assert [r["role"] for r in send_case] == ["train"] * R + ["generate"] * (T * replicas)
    for record in send_case[R:]:
        for version in ("v1", "v2"):  # initial weights, then after a step (oracle: full_tensor())
            check = record[version]
            assert check["names_diff"] == [] and check["mismatched"] == [], (version, check)


def test_disaggregated_sender_peak_is_one_bucket_plus_one_chunk(send_case: list[dict[str, Any]]) -> None:
    numel = ReshardConfig(bucket_bytes=BUCKET_BYTES).staging_numel(ITEMSIZE)
    assert numel is not None
    chunk = numel * ITEMSIZE
    R = SEND_CASE[0]
    for record in send_case[:R]:
        for version in ("v1", "v2"):
            report = record[version]
            assert report["buckets"] >= 5 and report["staging"] == chunk, report
            assert report["largest_bucket_bytes"] <= BUCKET_BYTES
            assert report["peak_extra_bytes"] <= report["largest_bucket_bytes"] + chunk, report
            assert report["peak_extra_bytes"] <= BUCKET_BYTES + chunk, report
    for record in send_case[R:]:
        assert record["v1_staging"] == chunk and record["v1_report"]["peak_extra_bytes"] <= chunk
