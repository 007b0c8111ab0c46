"""Colocated reshard on real gloo process groups: R in {2, 4}, T in {1, 2, 4} where T divides R.

The train side is the FSDP2 engine (R = 4: FSDP x TP 2x2 over ``build_mesh("cpu", 2)``; R = 2:
FSDP dp 2, vocab 17 so the embedding shards are uneven), trained a few GRPO steps; the resharder
reads its ``to_local()`` shards through ``spec_for_placements``. One world per train layout
(process start-up dominates; see ``reshard_worlds``), several properties asserted per world: the
sharded steps match an unsharded reference, every inference rank holds exactly the oracle's slice
(bitwise), the TP forward over those slices gives the full model's logits, the peak extra memory
stays within one bucket, the awaitables do not block the loop, and training with a reshard +
offload/reload between steps is identical to training without. (The FSDP2-specific claims, from
``full_tensor()``, are spelled out in test_reshard_fsdp2.py over the same worlds.)
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.reshard import reshard_workers as workers
from tests.reshard import reshard_worlds as worlds

BUCKET_BYTES = worlds.BUCKET_BYTES
World = tuple[str, list[dict[str, Any]]]


@pytest.fixture(scope="module", params=list(worlds.COLOCATED_WORLDS))
def world(request: pytest.FixtureRequest) -> World:
    return request.param, worlds.colocated(request.param)


def _cases(world: World) -> list[tuple[int, str, dict[str, Any]]]:
    _, results = world
    return [(rank, T, case) for rank, r in enumerate(results) for T, case in r["matrix"]["by_t"].items()]


def test_sharded_steps_match_an_unsharded_reference(world: World) -> None:
    name, results = world
    R, P, _, _ = worlds.COLOCATED_WORLDS[name]
    reference = results[0]["matrix"]["train"]
    assert reference["max_param_diff"] < 2e-5, reference  # seen ~2e-6 after 3 AdamW steps at lr 1e-3
    assert reference["losses"] == pytest.approx(reference["ref_losses"], rel=1e-5, abs=1e-6)
    for result in results:
        train = result["matrix"]["train"]
        assert train["layout"] == [R, P]
        assert train["losses"] == reference["losses"]  # global statistics: the same on every rank
        assert train["moved_from_init"] > 1e-3  # the steps really changed the weights
        assert train["state_dict_equals_full_tensor"]


def test_every_inference_rank_holds_its_exact_slice(world: World) -> None:
    seen: dict[str, set[int]] = {}
    for rank, T, case in _cases(world):
        assert case["names_diff"] == [], (rank, T, case["names_diff"])
        assert case["mismatched"] == [], f"rank {rank}, T={T}: {case['mismatched']}"
        assert case["naive_equal"], (rank, T)
        seen.setdefault(T, set()).add(case["inference_rank"])
    assert all(ranks == set(range(int(T))) for T, ranks in seen.items()), seen


def test_tensor_parallel_logits_equal_unsharded_logits(world: World) -> None:
    vocab = worlds.COLOCATED_WORLDS[world[0]][3]
    for rank, T, case in _cases(world):
        assert case["logits_shape"] == [2, workers.SEQ, vocab]
        assert case["logits_max_diff"] < 1e-5, (rank, T, case["logits_max_diff"])


def test_peak_extra_memory_is_one_bucket(world: World) -> None:
    world_size = len(world[1])
    for rank, T, case in _cases(world):
        assert case["buckets"] >= 5, case["buckets"]
        assert case["peak_extra_bytes"] == case["largest_bucket_bytes"] <= BUCKET_BYTES, (rank, T, case)
        # the naive reshard holds the whole gathered model: R slots of the padded shards
        assert case["naive_peak_extra_bytes"] == world_size * case["slot_bytes"]
        assert case["naive_peak_extra_bytes"] >= 5 * case["peak_extra_bytes"]
        # every inference byte is written once, except the vocab padding rows (never written)
        assert case["sliced_bytes"] == case["inference_bytes"] - case["padding_bytes"]
        assert case["bytes_moved"] == (world_size - 1) * case["slot_bytes"]
        assert len(case["bucket_times"]) == case["buckets"]


def test_vocab_padding_is_left_unwritten_where_the_vocab_does_not_split(world: World) -> None:
    padded = [case for _, _, case in _cases(world) if case["padding_bytes"]]
    if world[0] == "R2-P1":  # vocab 17 at T = 2: inference rank 1 holds one padding row per vocab tensor
        assert padded and all(case["inference_rank"] == 1 for case in padded)
    else:
        assert padded == []


def test_awaitable_transitions_leave_the_loop_running(world: World) -> None:
    for result in world[1]:
        record = result["matrix"]["awaitable"]
        assert record["order"] == ["to_inference", "generator saw 5"]
        assert record["lease_version"] == 5 and record["qkv_nonzero"]
        assert record["ticks_during"] > 10, record  # the loop kept running while the reshard worked
        assert record["reshard_buckets"] > 1
        # the phases: training state offloaded while generation holds the weights, back after
        assert record["phase_after_to_inference"] == "inference" and record["state_on_host_in_inference"]
        assert record["phase_after_to_training"] == "training" and record["engine_on_device"]
        # on CPU the state already lives in host memory: the swap moves nothing
        assert record["swap_out"] == ["to_host", 0] and record["swap_in"] == ["to_device", 0]
        assert record["released_version"] is None  # weights released for the training phase
        assert record["double_to_training"] == "PhaseError"


def test_training_with_swaps_between_steps_is_identical_to_training_without(world: World) -> None:
    for result in world[1]:
        swap = result["swap"]
        assert swap["swapped_losses"] == swap["plain_losses"]  # bitwise: same floats
        assert swap["params_equal"]
        assert swap["refused_versions"] == [1, 2, 3, 4]  # no compute while the state is offloaded
        # every step: inference phase with the state offloaded, then training with it back (0 bytes
        # moved: CPU)
        assert swap["phases"] == [["inference", True, "to_host", 0], ["training", False, "to_device", 0]] * 4
        # a round trip with gradients mid-step and AdamW moments restores the state bitwise
        assert swap["snapshot_kinds"] == ["data", "exp_avg", "exp_avg_sq", "grad", "step"]
        assert swap["round_trip_equal"] and swap["on_host"] and swap["read_refused"]
        assert swap["swap"] == ["to_host", 0, "to_device", 0]
        # the step that was in flight finishes as it does without the round trip
        assert swap["final_losses"][0] == swap["final_losses"][1]
        assert swap["params_equal_after_round_trip"]
