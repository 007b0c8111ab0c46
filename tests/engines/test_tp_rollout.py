"""The tensor-parallel rollout engine on real gloo groups equals the single-process engine.

One spawned world per T (start-up dominates), every check inside; see ``tp_rollout_workers``.
T = 2 splits the 2 kv heads; T = 4 replicates each kv head on two ranks and pads the vocabulary.
Sampled runs compare tokens exactly: rank 0 draws from the same generator stream as the
reference, and the TP logits differ from the full model's only by float rounding (~1e-6),
far from moving a multinomial draw across a token boundary for these seeds.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch

from streamrl.engines.rollout import TorchRolloutEngine
from streamrl.engines.tp_rollout import TensorParallelRolloutEngine, TensorParallelRolloutError
from streamrl.models.functional import UnsupportedModelError
from streamrl.reshard import ModelShardingSpec
from tests.engines.tp_rollout_workers import (
    EOS,
    PAD,
    PROMPTS,
    RUNS,
    inference_slice,
    model_config,
    prompt_tensors,
    tp_world,
)
from tests.reshard.reshard_harness import build_model, run_world, tiny_config

MODELS = ["qwen2", "llama"]
LOGPROB_ATOL = 1e-4


def _assert_same_as_reference(tp: list, reference: list, where: str) -> None:
    assert len(tp) == len(reference) == len(PROMPTS), where
    for row, ((ids, logprobs, reason), (ref_ids, ref_logprobs, ref_reason)) in enumerate(zip(tp, reference, strict=True)):
        assert ids == ref_ids and reason == ref_reason, f"{where} row {row}: {ids} {reason} vs {ref_ids} {ref_reason}"
        diff = max((abs(a - b) for a, b in zip(logprobs, ref_logprobs, strict=True)), default=0.0)
        assert diff < LOGPROB_ATOL, f"{where} row {row}: logprobs differ by {diff}"


def _check_world(results: list[dict[str, Any]], world: int) -> None:
    for name in MODELS:
        by_rank = [r[name] for r in results]
        head = by_rank[0]
        for rank, record in enumerate(by_rank):
            prefill = record["prefill"]
            assert prefill["vs_hf"] < 1e-5 and prefill["vs_tensor_parallel_logits"] < 1e-5, (name, rank, prefill)
            assert prefill["vocab"] == model_config(name).vocab_size  # padding columns trimmed
            assert prefill["cached_kv_heads"] == max(1, 2 // world)  # this rank's kv heads only
            # Every rank returns exactly rank 0's generations (tokens, logprobs, reasons).
            for run, _, _ in RUNS:
                assert record[run]["tp"] == head[run]["tp"], (name, run, rank)
            assert record["generator"]["tp"] == head["generator"]["tp"]
            assert record["rebind"]["first"] == head["rebind"]["first"]
            assert record["rebind"]["second"] == head["rebind"]["second"]
            assert record["rebind"]["weights_released"], "the engine kept a reference to released weights"

            errors = record["errors"]
            assert "no error" not in errors.values(), errors
            if rank == 1:
                assert "lack 1 name" in errors["missing_on_rank_1"] and "model.norm.weight" in errors["missing_on_rank_1"]
            else:
                assert "another rank" in errors["missing_on_rank_1"]
            assert "is (" in errors["other_t"] and f"at T={world}" in errors["other_t"]
            assert "different prompts" in errors["prompts_differ"]
            assert "top_p" in errors["bad_argument"]
            assert f"tensor_parallel={world + 1}" in errors["tensor_parallel_mismatch"]

        for run, _, compact_below in RUNS:
            _assert_same_as_reference(head[run]["tp"], head[run]["reference"], f"{name} T={world} {run}")
            reasons = [reason for _, _, reason in head[run]["tp"]]
            if compact_below > 0:  # some rows stop on EOS while others go on
                assert "eos" in reasons and "length" in reasons, (name, run, reasons)
            if compact_below == 1.0:
                assert head[run]["cache_rows_after"] < len(PROMPTS), "finished rows were never compacted"
        # Rows i, i+4, i+8 repeat one prompt: sampled independently, greedy alike.
        sampled = [tuple(ids) for ids, _, _ in head["sampled"]["tp"]]
        assert len(set(sampled[0:12:4])) > 1 or len(set(sampled[1:12:4])) > 1
        greedy = [tuple(ids) for ids, _, _ in head["greedy"]["tp"]]
        assert all(greedy[i] == greedy[i + 4] == greedy[i + 8] for i in range(4))
        _assert_same_as_reference(head["rebind"]["second"], head["rebind"]["reference_second"], f"{name} rebind")
        assert head["rebind"]["first"] != head["rebind"]["second"]  # the new weights were used
        _assert_same_as_reference(head["generator"]["tp"], head["generator"]["reference"], f"{name} generator")


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4: the slow tier
def test_tp_rollout_equals_single_process_engine(world: int) -> None:
    _check_world(run_world(tp_world, world, MODELS, timeout_s=120.0), world)


# -- T = 1 in this process (group=None) and refusals that need no group --------------------------
@pytest.mark.parametrize("name", [*MODELS, "mistral"])
def test_t1_without_a_group_equals_single_process_engine(name: str) -> None:
    config = model_config(name)
    model = build_model(config).eval()
    weights = inference_slice(model, ModelShardingSpec.from_config(config), 1, 0)
    engine = TensorParallelRolloutEngine(config, EOS, PAD, group=None, compact_below=1.0)
    reference = TorchRolloutEngine(model, EOS, PAD, "cpu", compact_below=1.0)
    for kwargs in ({"max_new_tokens": 8, "top_k": 1}, {"max_new_tokens": 8, "seed": 3}):
        tp = engine.generate(prompt_tensors(), weights=weights, **kwargs)
        ref = reference.generate(prompt_tensors(), **kwargs)
        for a, b in zip(tp, ref, strict=True):
            assert torch.equal(a.response_ids, b.response_ids) and a.finish_reason == b.finish_reason
            torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=1e-5)
    released = weakref.ref(weights["lm_head.weight"])
    del weights
    gc.collect()
    assert released() is None, "the engine kept a reference to the weights of a finished call"


def test_refusals_name_the_problem() -> None:
    config = model_config("qwen2")
    model = build_model(config)
    spec = ModelShardingSpec.from_config(config)
    engine = TensorParallelRolloutEngine(config, EOS, PAD, group=None)
    weights = inference_slice(model, spec, 1, 0)
    prompts = prompt_tensors()
    with pytest.raises(TensorParallelRolloutError, match=r"tensor_parallel=2 but the inference group has 1 rank"):
        TensorParallelRolloutEngine(config, EOS, PAD, group=None, tensor_parallel=2)
    with pytest.raises(TensorParallelRolloutError, match=r"lack 1 name.*lm_head.weight"):
        engine.generate(prompts, weights={n: w for n, w in weights.items() if n != "lm_head.weight"}, max_new_tokens=2)
    with pytest.raises(TensorParallelRolloutError, match=r"lack .*(Hugging Face names)"):
        engine.generate(prompts, weights=model.state_dict(), max_new_tokens=2)
    with pytest.raises(TensorParallelRolloutError, match=r"outside .*: \['extra'\]"):
        engine.generate(prompts, weights={**weights, "extra": torch.zeros(1)}, max_new_tokens=2)
    with pytest.raises(TensorParallelRolloutError, match=r"must be torch.float32.*model.norm.weight is torch.float64"):
        engine.generate(prompts, weights={**weights, "model.norm.weight": weights["model.norm.weight"].double()},
                        max_new_tokens=2)
    windowed = tiny_config(use_sliding_window=True, sliding_window=4, max_window_layers=0)
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        TensorParallelRolloutEngine(windowed, EOS, PAD, group=None)
