"""Layout geometry, inference plans, bucket plans and refusals: in one process, no collectives.

The multi-process tests check the real all-gather path on a few layouts; here the same slicing
runs on shards built per rank in memory (what the all-gather would deliver), so every supported
(R, P, T) combination, vocab padding, kv-head replication, tied embeddings, Llama and Mistral are
covered quickly, against the hand-written oracle.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from transformers import LlamaConfig, MistralConfig, PretrainedConfig

from streamrl.models.build import TinyModelSpec
from streamrl.models.build import build_model as build_tiny
from streamrl.models.tokenizer import build_char_tokenizer
from streamrl.reshard import (
    InferenceLayout,
    LayoutError,
    ModelShardingSpec,
    ParamSpec,
    ReshardConfig,
    Topology,
    TrainLayout,
    local_hf_views,
    plan_buckets,
    shard_state,
    shard_tensor,
    train_block,
)
from streamrl.reshard.shards import copy_rect, source_blocks
from streamrl.reshard.spec import full_rect
from tests.reshard.reshard_harness import build_model, tiny_config
from tests.reshard.reshard_workers import expected_slice


# -- training shards ----------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 13),
    cols=st.integers(1, 5),
    tp_dim=st.sampled_from([None, 0, 1]),
    P=st.sampled_from([1, 2, 3]),
    dp=st.integers(1, 5),
)
def test_train_blocks_tile_the_full_tensor_and_reassemble_it(
    rows: int, cols: int, tp_dim: int | None, P: int, dp: int
) -> None:
    shape = (rows * P, cols * P)  # TP splits must be even; dp shards may be ragged (padded)
    param = ParamSpec("w", shape, tp_dim)
    layout = TrainLayout(P * dp, P)
    full = torch.randn(shape)
    coverage = torch.zeros(shape, dtype=torch.int32)
    for _rank, block in source_blocks(param, layout):
        (r0, r1), (c0, c1) = block.rect
        coverage[r0:r1, c0:c1] += 1
    assert bool((coverage == 1).all()), "each element must come from exactly one source block"
    shards = [shard_tensor(full, param, layout, r) for r in range(layout.world_size)]
    assert len({s.shape for s in shards}) == 1  # equal sizes: one flat all-gather
    for r, shard in enumerate(shards):  # padding rows are zero
        block = train_block(param, layout, r)
        valid = 0 if block.rect is None else block.rect[0][1] - block.rect[0][0]
        assert bool((shard[valid:] == 0).all())
    out = torch.empty(shape)
    copy_rect(out, (0, 0), full_rect(shape), [(b.rect, shards[r]) for r, b in source_blocks(param, layout)])
    assert torch.equal(out, full)


# -- inference slices ---------------------------------------------------------------------------
def _simulated_reshard(config, full, layout: TrainLayout, T: int) -> list[dict[str, torch.Tensor]]:
    """The resharder's slicing over per-rank shards built in memory instead of all-gathered."""
    return _simulated_reshard_of(ModelShardingSpec.from_config(config), full, layout, T)


def _simulated_reshard_of(
    spec: ModelShardingSpec, full: dict[str, torch.Tensor], layout: TrainLayout, T: int
) -> list[dict[str, torch.Tensor]]:
    shards = [shard_state(full, spec.params, layout, r) for r in range(layout.world_size)]
    views = {p.name: [(b.rect, shards[r][p.name]) for r, b in source_blocks(p, layout)] for p in spec.params}
    plan = spec.inference_plan(T)
    outs = []
    for t in range(T):
        out = {n: torch.zeros(s) for n, s in plan.shapes.items()}
        for piece in plan.pieces[t]:
            copy_rect(out[piece.target], piece.target_origin, piece.source_rect, views[piece.source])
        outs.append(out)
    return outs


# Llama and Mistral: the same tiny sizes, GQA with one and two kv heads
SIZES = {"vocab_size": 16, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "tie_word_embeddings": False}
MODELS = {
    "qwen2": tiny_config(),
    "qwen2-padded-vocab-tied": tiny_config(vocab_size=18, tie_word_embeddings=True),
    "qwen2-mha-8heads": tiny_config(num_attention_heads=8, num_key_value_heads=8, vocab_size=24),
    "llama-gqa": LlamaConfig(**SIZES, num_key_value_heads=1),
    "mistral": MistralConfig(**SIZES, num_key_value_heads=2),
}


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize(("R", "P"), [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (3, 1), (6, 2)])
def test_inference_slices_match_the_oracle(model: str, R: int, P: int) -> None:
    config = MODELS[model]
    spec = ModelShardingSpec.from_config(config)
    if spec.num_kv_heads % P:  # llama-gqa has one kv head: training TP cannot split it
        with pytest.raises(LayoutError, match="num_key_value_heads=1"):
            spec.check_train_layout(TrainLayout(R, P))
        return
    full = {k: v.detach() for k, v in build_model(config).named_parameters()}
    for T in (1, 2, 4):
        outs = _simulated_reshard(config, full, TrainLayout(R, P), T)
        for t, out in enumerate(outs):
            expected = expected_slice(full, config, T, t)
            assert out.keys() == expected.keys()
            for name in expected:
                assert torch.equal(out[name], expected[name]), (model, R, P, T, t, name)


@pytest.mark.parametrize("model", ["qwen2", "qwen2-padded-vocab-tied"])
def test_hf_views_of_a_single_rank_are_the_state_dict(model: str) -> None:
    config = MODELS[model]
    spec = ModelShardingSpec.from_config(config)
    hf = build_model(config)
    full = {k: v.detach() for k, v in hf.named_parameters()}
    (out,) = _simulated_reshard(config, full, TrainLayout(2), 1)
    views = local_hf_views(out, spec.inference_plan(1), 0)
    assert views.keys() == full.keys()
    assert all(torch.equal(views[k], full[k]) for k in full)
    hf.load_state_dict(views, strict=not config.tie_word_embeddings)  # what a rollout engine would do
    two = _simulated_reshard(config, full, TrainLayout(2), 2)
    q = local_hf_views(two[1], spec.inference_plan(2), 1)["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(q, full["model.layers.0.self_attn.q_proj.weight"][32:64])
    assert q.data_ptr() == two[1]["model.layers.0.self_attn.qkv_proj.weight"].data_ptr()  # a view


def test_vocab_padding_rows_stay_zero_and_are_not_written() -> None:
    spec = ModelShardingSpec.from_config(tiny_config(vocab_size=18))
    plan = spec.inference_plan(4)  # 18 -> 20 rows, 5 per rank; rank 3 holds 3 real rows
    assert plan.shapes["model.embed_tokens.weight"] == (5, 64)
    rows = [p for p in plan.pieces[3] if p.target == "model.embed_tokens.weight"]
    assert [p.source_rect[0] for p in rows] == [(15, 18)]


@pytest.mark.parametrize("T", [1, 2, 4])
def test_each_target_element_is_written_exactly_once(T: int) -> None:
    spec = ModelShardingSpec.from_config(tiny_config(vocab_size=18))
    plan = spec.inference_plan(T)
    for t in range(T):
        coverage = {n: torch.zeros(s, dtype=torch.int32) for n, s in plan.shapes.items()}
        for piece in plan.pieces[t]:
            region = tuple(slice(lo, hi) for lo, hi in piece.target_rect())
            coverage[piece.target][region] += 1
        for name, count in coverage.items():
            padding = (
                name in ("model.embed_tokens.weight", "lm_head.weight")
                and (t + 1) * plan.shapes[name][0] > 18
            )
            if padding:
                real = 18 - t * plan.shapes[name][0]
                assert bool((count[:real] == 1).all()) and bool((count[real:] == 0).all())
            else:
                assert bool((count == 1).all()), (T, t, name)


# -- buckets ------------------------------------------------------------------------------------
@pytest.mark.parametrize("cap", [1, 10_000, 40_000, 200_000, None])
def test_bucket_plan_keeps_order_and_the_cap(cap: int | None) -> None:
    spec = ModelShardingSpec.from_config(tiny_config())
    layout = TrainLayout(2)
    buckets = plan_buckets(spec.params, layout, cap, itemsize=4)
    assert [p for b in buckets for p in b.params] == list(spec.params)
    assert [b.index for b in buckets] == list(range(len(buckets)))
    for b in buckets:
        assert len(b.params) == 1 or cap is None or b.gathered_bytes(2, 4) <= cap
        assert b.offsets[0] == 0 and list(b.offsets) == sorted(b.offsets)
    if cap is None:
        assert len(buckets) == 1
    if cap == 1:
        assert len(buckets) == len(spec.params)


# -- refusals -----------------------------------------------------------------------------------
def test_colocated_needs_t_to_divide_r() -> None:
    with pytest.raises(LayoutError, match=r"T=4.*R=2.*disaggregated"):
        Topology.colocated(TrainLayout(2), 4)
    assert Topology.disaggregated(TrainLayout(2), 4).world_size == 6
    assert Topology.disaggregated(TrainLayout(2), 3).weight_destinations(0) == (2, 4)
    with pytest.raises(LayoutError, match="replicas"):
        Topology("colocated", TrainLayout(4), InferenceLayout(2, 1))


def test_bad_layouts_are_refused_with_the_field_named() -> None:
    with pytest.raises(LayoutError, match="tensor_parallel=3 must divide train world_size=4"):
        TrainLayout(4, 3)
    with pytest.raises(LayoutError, match="world_size"):
        TrainLayout(0)
    with pytest.raises(LayoutError, match="placement"):
        Topology("sideways", TrainLayout(2), InferenceLayout(1, 2))  # type: ignore[arg-type]
    spec = ModelShardingSpec.from_config(tiny_config())
    with pytest.raises(LayoutError, match="num_attention_heads=4"):
        spec.inference_plan(3)
    with pytest.raises(LayoutError, match="num_key_value_heads=2"):
        spec.check_train_layout(TrainLayout(4, 4))
    with pytest.raises(LayoutError, match="model_type"):
        ModelShardingSpec.from_config(type("C", (), {"model_type": "gpt2"})())
    with pytest.raises(ValueError, match="bucket_bytes"):
        ReshardConfig(bucket_bytes=0)


def test_kv_heads_are_replicated_when_t_exceeds_them() -> None:
    spec = ModelShardingSpec.from_config(tiny_config())  # 4 q heads, 2 kv heads, head_dim 16
    plan = spec.inference_plan(4)
    assert plan.shapes["model.layers.0.self_attn.qkv_proj.weight"] == ((1 + 2) * 16, 64)
    k_rows = [
        next(p.source_rect[0] for p in plan.pieces[t] if p.source.endswith("k_proj.weight")) for t in range(4)
    ]
    assert k_rows == [(0, 16), (0, 16), (16, 32), (16, 32)]


# -- from_model: the Llama family as from_config, anything else generic ------------------------------
GPT2 = TinyModelSpec(arch="gpt2", hidden=32, layers=2, heads=4, intermediate=64, seed=1)


@pytest.mark.parametrize("model", list(MODELS))
def test_from_model_equals_from_config_for_the_llama_family(model: str) -> None:
    config = MODELS[model]
    assert ModelShardingSpec.from_model(build_model(config)) == ModelShardingSpec.from_config(config)
    tiny = build_tiny(TinyModelSpec(hidden=32, layers=2, heads=4, intermediate=64), build_char_tokenizer())
    spec = ModelShardingSpec.from_model(tiny)
    assert spec == ModelShardingSpec.from_config(tiny.config) and spec.llama_family


def test_from_model_refuses_a_llama_family_module_that_its_config_does_not_describe() -> None:
    model = build_model(tiny_config())
    model.model.extra = nn.Parameter(torch.zeros(3))  # e.g. an adapter the config knows nothing of
    with pytest.raises(LayoutError, match=r"do not match the qwen2 sharding spec.*unexpected \['model.extra'\]"):
        ModelShardingSpec.from_model(model)


def test_generic_spec_lists_what_named_parameters_lists() -> None:
    model = build_tiny(GPT2, build_char_tokenizer())
    spec = ModelShardingSpec.from_model(model)
    named = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    assert (spec.model_type, spec.llama_family, spec.tied_embeddings) == ("gpt2", False, True)
    assert [(p.name, p.shape) for p in spec.params] == named  # same names, shapes and order
    assert all(p.train_tp_dim is None for p in spec.params)  # replicated over train TP
    # lm_head.weight is transformer.wte.weight: one Parameter, listed once, as the trainer sees it.
    assert "lm_head.weight" not in spec.names and "transformer.wte.weight" in spec.names
    assert spec.numel() == sum(p.numel() for p in model.parameters())
    assert (spec.vocab_size, spec.hidden_size, spec.num_layers, spec.num_heads, spec.intermediate_size) == (
        15, 32, 2, 4, 64
    )


def test_generic_plan_at_t1_is_the_parameters_themselves() -> None:
    tok = build_char_tokenizer()
    model = build_tiny(GPT2, tok)
    spec = ModelShardingSpec.from_model(model)
    plan = spec.inference_plan(1)
    full = {k: v.detach() for k, v in model.named_parameters()}
    assert plan.shapes == {k: tuple(v.shape) for k, v in full.items()}
    (pieces,) = plan.pieces
    assert [(p.source, p.target) for p in pieces] == [(n, n) for n in spec.names]  # identity, each once
    assert all(p.source_rect == full_rect(p.shape) and not any(p.target_origin) for p in pieces)
    coverage = {n: torch.zeros(s, dtype=torch.int32) for n, s in plan.shapes.items()}
    for piece in pieces:
        coverage[piece.target][tuple(slice(lo, hi) for lo, hi in piece.target_rect())] += 1
    assert all(bool((c == 1).all()) for c in coverage.values())
    for R in (1, 2, 3):  # dp shards along dim 0 (ragged for R = 3), gathered back whole
        (out,) = _simulated_reshard_of(spec, full, TrainLayout(R), 1)
        views = local_hf_views(out, plan, 0)
        assert views.keys() == full.keys()
        assert all(torch.equal(views[k], full[k]) for k in full)
        assert all(views[k].data_ptr() == out[k].data_ptr() for k in full)  # views, not copies
    # What a rollout engine does with them: load into another GPT-2 and get the same outputs.
    other = build_tiny(TinyModelSpec(arch="gpt2", hidden=32, layers=2, heads=4, intermediate=64, seed=2), tok)
    result = other.load_state_dict(views, strict=False)
    assert result.unexpected_keys == [] and result.missing_keys == ["lm_head.weight"]  # the tied alias
    assert other.lm_head.weight is other.transformer.wte.weight
    ids = torch.tensor([tok("12+3=")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(other.eval()(ids).logits, model.eval()(ids).logits)


def test_generic_spec_refuses_tensor_parallelism_with_a_clear_message() -> None:
    spec = ModelShardingSpec.from_model(build_tiny(GPT2, build_char_tokenizer()))
    with pytest.raises(LayoutError, match=r"inference tensor_parallel T=2 needs a Llama-family model.*gpt2.*T=1"):
        spec.inference_plan(2)
    with pytest.raises(LayoutError, match="T=4 needs a Llama-family model"):
        spec.check_inference_tp(4)
    with pytest.raises(LayoutError, match=r"train tensor_parallel=2 needs a Llama-family model.*tensor_parallel 1"):
        spec.check_train_layout(TrainLayout(4, 2))
    spec.check_train_layout(TrainLayout(4))  # data-parallel sharding alone works for any model
    buckets = plan_buckets(spec.params, TrainLayout(4), 4096, itemsize=4)
    assert [p for b in buckets for p in b.params] == list(spec.params)


def test_from_named_shapes_refusals() -> None:
    with pytest.raises(LayoutError, match="no parameters"):
        ModelShardingSpec.from_named_shapes("x", [])
    with pytest.raises(LayoutError, match=r"unique.*\['a'\]"):
        ModelShardingSpec.from_named_shapes("x", [("a", (2,)), ("a", (3,))])
    with pytest.raises(LayoutError, match=r"0-d \(scalar\) parameters \['scale'\]"):
        ModelShardingSpec.from_named_shapes("x", [("w", (2, 2)), ("scale", ())])
    spec = ModelShardingSpec.from_named_shapes("x", [("w", (4, 2)), ("b", (4,))], config=PretrainedConfig())
    assert spec.names == ("w", "b") and spec.inference_plan(1).shapes == {"w": (4, 2), "b": (4,)}
