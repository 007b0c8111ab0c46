"""Rank bodies for the tensor-parallel rollout tests (importable by the spawned gloo ranks).

Each rank builds the same seeded full model, cuts its inference slice through the real plan
(``spec.inference_plan(T)`` pieces + ``copy_rect``, what the reshard does per bucket), and runs
``TensorParallelRolloutEngine``; rank 0 also runs the single-process ``TorchRolloutEngine`` on
the full model as the reference. Values come back as JSON (tokens, float logprobs, reasons).
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch
import torch.distributed as dist
from transformers import LlamaConfig, MistralConfig, PretrainedConfig

from streamrl.engines.rollout import GenerateArgumentError, Generation, TorchRolloutEngine
from streamrl.engines.tp_rollout import TensorParallelRolloutEngine, TensorParallelRolloutError
from streamrl.reshard import ModelShardingSpec, rope_theta, tensor_parallel_logits
from streamrl.reshard.shards import copy_rect
from streamrl.reshard.spec import full_rect
from tests.reshard.reshard_harness import build_model, tiny_config

EOS, PAD = 3, 0
# Ragged prompts, three GRPO-style copies of four of them, one single.
BASE_PROMPTS = [[1, 5, 7], [2], [4, 4, 9, 10, 11, 3, 6], [8, 1]]
PROMPTS = BASE_PROMPTS * 3 + [[12, 13, 0, 5]]


def model_config(name: str) -> PretrainedConfig:
    """Tiny GQA models (nkv=2 < nh=4) whose vocabulary T=4 must pad."""
    if name == "qwen2":  # q/k/v biases, untied lm_head, vocab 18 -> 20 at T=4
        return tiny_config(vocab_size=18)
    if name == "mistral":  # no biases, untied, no sliding window (the functional forward refuses one)
        return MistralConfig(
            vocab_size=18, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, sliding_window=None, tie_word_embeddings=False,
        )
    # Llama with attention_bias (a replicated o_proj bias) and tied embeddings, vocab 15 -> 16
    return LlamaConfig(
        vocab_size=15, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attention_bias=True, tie_word_embeddings=True,
    )


def inference_slice(model: torch.nn.Module, spec: ModelShardingSpec, T: int, t: int) -> dict[str, torch.Tensor]:
    """Rank t's fused weights, cut from the full state dict by the real inference plan."""
    plan = spec.inference_plan(T)
    full = model.state_dict()
    out = {name: torch.zeros(shape) for name, shape in plan.shapes.items()}
    for piece in plan.pieces[t]:
        source = full[piece.source]
        copy_rect(out[piece.target], piece.target_origin, piece.source_rect, [(full_rect(tuple(source.shape)), source)])
    return out


def prompt_tensors(prompts: list[list[int]] = PROMPTS) -> list[torch.Tensor]:
    return [torch.tensor(p, dtype=torch.int64) for p in prompts]


def as_json(gens: list[Generation]) -> list[list[Any]]:
    return [[g.response_ids.tolist(), g.logprobs.tolist(), g.finish_reason] for g in gens]


# An EOS that these seeded models' greedy decoding emits early in some rows only (found by
# running them), so the greedy run covers EOS stop and compaction too.
GREEDY_EOS = {"qwen2": 1, "llama": 2}
# (name, generate kwargs, compact_below): greedy and sampled, compacting at every finished row
# (1.0), at the default fraction (0.75) and never (0.0).
RUNS: list[tuple[str, dict[str, Any], float]] = [
    ("greedy", {"max_new_tokens": 10, "top_k": 1}, 1.0),
    ("sampled", {"max_new_tokens": 12, "temperature": 0.8, "seed": 5}, 1.0),
    ("sampled_default_compaction", {"max_new_tokens": 12, "seed": 7}, 0.75),
    ("sampled_top_p_no_compaction", {"max_new_tokens": 8, "top_p": 0.9, "top_k": 6, "seed": 9}, 0.0),
]


def _prefill_checks(engine: TensorParallelRolloutEngine, weights: dict, model: Any, config: Any) -> dict:
    """TP prefill logits vs the HF model (ragged, packed) and vs tensor_parallel_logits (dense)."""
    fn = engine.functional(weights)
    rows = prompt_tensors(BASE_PROMPTS)
    ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=PAD)
    lengths = torch.tensor([len(r) for r in rows])
    with torch.inference_mode():
        kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        hidden, _ = fn.forward_packed(ids, lengths, kv_out=kv)
        logits = fn.logits(hidden)
        hf = torch.cat([model(r.unsqueeze(0)).logits[0] for r in rows])
        dense = torch.tensor([[1, 5, 7, 2, 9], [4, 4, 9, 10, 11]])
        tp_dense = fn.logits(fn.forward_packed(dense, torch.tensor([5, 5]))[0])
        reference = tensor_parallel_logits(
            weights, engine.spec, dense, rope_theta=rope_theta(config), rms_norm_eps=config.rms_norm_eps,
            inference_rank=engine.rank, tensor_parallel=engine.tensor_parallel, group=engine.group,
        )
    return {
        "vs_hf": float((logits - hf).abs().max()),
        "vs_tensor_parallel_logits": float((tp_dense - reference.reshape(-1, reference.shape[-1])).abs().max()),
        "vocab": logits.shape[-1],
        "cached_kv_heads": kv[0][0].shape[1],
    }


def _error_checks(rank: int, world: int, config: Any, spec: ModelShardingSpec, weights: dict) -> dict:
    """Refusals raise on every rank (none is left blocked in a collective), naming the problem."""
    engine = TensorParallelRolloutEngine(config, EOS, PAD, group=dist.group.WORLD)
    prompts = prompt_tensors()
    out: dict[str, str] = {}

    def attempt(key: str, **kwargs: Any) -> None:
        try:
            engine.generate(**{"prompts": prompts, "weights": weights, "max_new_tokens": 3, **kwargs})
            out[key] = "no error"
        except (TensorParallelRolloutError, GenerateArgumentError) as exc:
            out[key] = f"{type(exc).__name__}: {exc}"

    partial = {n: w for n, w in weights.items() if not (rank == 1 and n == "model.norm.weight")}
    attempt("missing_on_rank_1", weights=partial)
    attempt("other_t", weights=inference_slice(build_model(config), spec, 1, 0))
    attempt("prompts_differ", prompts=prompts[:-1] if rank == world - 1 else prompts)
    attempt("bad_argument", top_p=0.0)
    try:
        TensorParallelRolloutEngine(config, EOS, PAD, group=dist.group.WORLD, tensor_parallel=world + 1)
        out["tensor_parallel_mismatch"] = "no error"
    except TensorParallelRolloutError as exc:
        out["tensor_parallel_mismatch"] = str(exc)
    return out


def tp_world(rank: int, world: int, model_names: list[str]) -> dict:
    """One spawned world, every check (process start-up dominates the cost of these tests)."""
    result: dict[str, Any] = {}
    for name in model_names:
        config = model_config(name)
        spec = ModelShardingSpec.from_config(config)
        model, other = build_model(config, seed=0).eval(), build_model(config, seed=1).eval()
        weights = inference_slice(model, spec, world, rank)
        record: dict[str, Any] = {}
        probe = TensorParallelRolloutEngine(config, EOS, PAD, group=dist.group.WORLD, tensor_parallel=world)
        record["prefill"] = _prefill_checks(probe, weights, model, config)
        record["errors"] = _error_checks(rank, world, config, spec, weights)
        for run, kwargs, compact_below in RUNS:
            eos = GREEDY_EOS[name] if run == "greedy" else EOS
            engine = TensorParallelRolloutEngine(
                config, eos, PAD, group=dist.group.WORLD, tensor_parallel=world, compact_below=compact_below
            )
            gens = engine.generate(prompt_tensors(), weights=weights, **kwargs)
            entry: dict[str, Any] = {"tp": as_json(gens), "cache_rows_after": engine._cache.rows if engine._cache else None}
            if rank == 0:
                reference = TorchRolloutEngine(model, eos, PAD, "cpu", compact_below=compact_below)
                entry["reference"] = as_json(reference.generate(prompt_tensors(), **kwargs))
            record[run] = entry

        # New weights on the next call, through the same engine (and its reused KV cache).
        engine = TensorParallelRolloutEngine(config, EOS, PAD, group=dist.group.WORLD)
        kwargs = {"max_new_tokens": 6, "top_k": 1}
        first = engine.generate(prompt_tensors(), weights=weights, **kwargs)
        lease = inference_slice(other, spec, world, rank)  # stands for an InferenceWeights.use() dict
        probe_ref = weakref.ref(lease["model.layers.0.self_attn.qkv_proj.weight"])
        second = engine.generate(prompt_tensors(), weights=lease, **kwargs)
        del lease
        gc.collect()
        record["rebind"] = {"first": as_json(first), "second": as_json(second), "weights_released": probe_ref() is None}
        if rank == 0:
            record["rebind"]["reference_second"] = as_json(
                TorchRolloutEngine(other, EOS, PAD, "cpu").generate(prompt_tensors(), **kwargs)
            )
        # Generic per-call generator on rank 0 (a caller's stream), as TorchRolloutEngine takes it.
        stream = torch.Generator().manual_seed(11)
        record["generator"] = {"tp": as_json(engine.generate(prompt_tensors(), weights=weights, max_new_tokens=5,
                                                             generator=stream))}
        if rank == 0:
            record["generator"]["reference"] = as_json(
                TorchRolloutEngine(model, EOS, PAD, "cpu").generate(
                    prompt_tensors(), max_new_tokens=5, generator=torch.Generator().manual_seed(11)
                )
            )
        result[name] = record
    return result
