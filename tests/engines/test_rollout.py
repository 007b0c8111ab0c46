"""The torch rollout engine: stopping, logprobs, sampling filters, determinism, per-prompt random streams, errors."""

from __future__ import annotations

import hashlib
import logging

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from streamrl.engines.logprob import LogprobEngine
from streamrl.engines.rollout import (
    SAMPLE_BLOCK,
    GenerateArgumentError,
    TorchRolloutEngine,
    inverse_transform,
    sample_tokens,
    stream_seed,
    stream_uniforms,
)
from streamrl.models.build import TinyModelSpec, build_model
from streamrl.models.matmul_precision import ieee_matmuls
from tests.engines.conftest import TINY, constant_model, encode

PROMPTS = ["1+2+3=", "45=", "9=", "1+2+3=", "7777777=", "45="]


def _engine(model: torch.nn.Module, tok: PreTrainedTokenizerFast, **kw: object) -> TorchRolloutEngine:
    return TorchRolloutEngine(model, tok.eos_token_id, tok.pad_token_id, "cpu", **kw)  # type: ignore[arg-type]


def test_eos_stops_a_sequence(tok: PreTrainedTokenizerFast) -> None:
    gens = _engine(constant_model(tok, eos_logit=60.0), tok).generate(encode(tok, PROMPTS), max_new_tokens=5, seed=0)
    for g in gens:
        assert g.response_ids.tolist() == [tok.eos_token_id]
        assert g.finish_reason == "eos"
        assert g.logprobs.dtype == torch.float32 and abs(float(g.logprobs[0])) < 1e-6


def test_max_new_tokens_stops_a_sequence(tok: PreTrainedTokenizerFast) -> None:
    gens = _engine(constant_model(tok, eos_logit=-60.0), tok).generate(encode(tok, PROMPTS), max_new_tokens=7, seed=0)
    for g in gens:
        assert g.response_ids.numel() == 7 and g.finish_reason == "length"
        assert tok.eos_token_id not in g.response_ids.tolist()
        # 14 tokens share the probability equally: each logprob is -log(14)
        torch.testing.assert_close(g.logprobs, torch.full((7,), -torch.log(torch.tensor(14.0)).item()))


@pytest.mark.parametrize("use_functional", [True, False])
@pytest.mark.parametrize("compact_below", [0.0, 0.75, 1.0])
def test_finish_invariants_on_a_random_model(
    model: torch.nn.Module, tok: PreTrainedTokenizerFast, use_functional: bool, compact_below: float
) -> None:
    engine = _engine(model, tok, use_functional=use_functional, compact_below=compact_below)
    gens = engine.generate(encode(tok, PROMPTS * 4), max_new_tokens=12, seed=1)
    assert len(gens) == 24
    reasons = set()
    for g in gens:
        ids = g.response_ids.tolist()
        assert g.response_ids.dtype == torch.int64 and g.logprobs.shape == g.response_ids.shape
        assert tok.eos_token_id not in ids[:-1]  # nothing after an EOS
        if g.finish_reason == "eos":
            assert ids[-1] == tok.eos_token_id
        else:
            assert len(ids) == 12 and ids[-1] != tok.eos_token_id
        reasons.add(g.finish_reason)
    assert reasons == {"eos", "length"}  # the random model does both here (ragged lengths)


@pytest.mark.parametrize("use_functional", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_the_logprob_engine_recomputation(
    model: torch.nn.Module, tok: PreTrainedTokenizerFast, use_functional: bool, temperature: float
) -> None:
    prompts = encode(tok, PROMPTS * 2)
    gens = _engine(model, tok, use_functional=use_functional).generate(
        prompts, max_new_tokens=10, temperature=temperature, seed=2
    )
    # LogprobEngine scores with the model's own forward, as the train engine does (packed prompts)
    recomputed = LogprobEngine(model, device="cpu").logprobs(
        prompts, [g.response_ids for g in gens], temperature=temperature
    )
    for g, r in zip(gens, recomputed, strict=True):
        torch.testing.assert_close(g.logprobs, r, atol=1e-5, rtol=1e-5)
    # And against the plain HF forward, token by token.
    with torch.no_grad():
        for p, g in zip(prompts, gens, strict=True):
            logits = model(torch.cat([p, g.response_ids]).unsqueeze(0)).logits[0, len(p) - 1 : -1]
            expected = torch.log_softmax(logits / temperature, -1).gather(1, g.response_ids.unsqueeze(1)).squeeze(1)
            torch.testing.assert_close(g.logprobs, expected, atol=1e-5, rtol=1e-5)


def test_a_lowered_matmul_precision_samples_the_same_policy(model: torch.nn.Module, tok: PreTrainedTokenizerFast,
                                                            medium_matmuls: None) -> None:
    """model.matmul_precision medium: the decode step's linear layers round their inputs to bfloat16,
    its attention over the cache does not; logprobs stay those of the float32 policy within that
    rounding, and the run's precision is left as it was."""
    prompts = encode(tok, PROMPTS * 2)
    gens = _engine(model, tok, use_functional=True).generate(prompts, max_new_tokens=10, seed=2)
    assert torch.get_float32_matmul_precision() == "medium"
    with ieee_matmuls():  # the float32 policy's own logprobs
        recomputed = LogprobEngine(model, device="cpu").logprobs(prompts, [g.response_ids for g in gens])
    for g, r in zip(gens, recomputed, strict=True):
        torch.testing.assert_close(g.logprobs, r, atol=0.05, rtol=0)  # bfloat16 inputs: ~3 significant digits


def test_a_bfloat16_model_keeps_its_kv_cache_in_float32_and_samples_its_policy(
    model: torch.nn.Module, tok: PreTrainedTokenizerFast
) -> None:
    """model.dtype bfloat16 on a CPU: the linear layers compute in bfloat16, attention in float32
    (streamrl.models.matmul_precision.attention_dtype), so the cache holds float32 keys and values;
    the logprobs are those of the model's own bfloat16 forward within bfloat16 rounding."""
    half = build_model(TINY, tok).to(torch.bfloat16)
    half.load_state_dict(model.state_dict())
    engine = _engine(half, tok, use_functional=True)
    prompts = encode(tok, PROMPTS * 2)
    gens = engine.generate(prompts, max_new_tokens=10, seed=2)
    assert engine._cache is not None and engine._cache.dtype == torch.float32
    assert all(g.logprobs.dtype == torch.float32 and g.response_ids.numel() >= 1 for g in gens)
    with torch.no_grad():
        for p, g in zip(prompts, gens, strict=True):
            logits = half(torch.cat([p, g.response_ids]).unsqueeze(0)).logits[0, len(p) - 1 : -1].float()
            expected = torch.log_softmax(logits, -1).gather(1, g.response_ids.unsqueeze(1)).squeeze(1)
            torch.testing.assert_close(g.logprobs, expected, atol=0.05, rtol=0)  # bfloat16: ~3 significant digits


def test_seed_makes_generation_reproducible(model: torch.nn.Module, tok: PreTrainedTokenizerFast) -> None:
    engine = _engine(model, tok)
    prompts = encode(tok, PROMPTS)
    a = engine.generate(prompts, max_new_tokens=8, seed=5)
    b = engine.generate(prompts, max_new_tokens=8, seed=5)
    c = engine.generate(prompts, max_new_tokens=8, seed=6)
    assert all(torch.equal(x.response_ids, y.response_ids) for x, y in zip(a, b, strict=True))
    assert all(torch.equal(x.logprobs, y.logprobs) for x, y in zip(a, b, strict=True))
    assert any(not torch.equal(x.response_ids, y.response_ids) for x, y in zip(a, c, strict=True))
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    d = engine.generate(prompts, max_new_tokens=8, generator=g1)
    e = engine.generate(prompts, max_new_tokens=8, generator=g2)
    assert all(torch.equal(x.response_ids, y.response_ids) for x, y in zip(d, e, strict=True))
    # The copies of one prompt are sampled independently.
    same = engine.generate(encode(tok, ["45="] * 16), max_new_tokens=6, seed=0)
    assert len({tuple(g.response_ids.tolist()) for g in same}) > 1


def test_top_k_and_top_p_restrict_the_draws() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).repeat(4000, 1)
    logits = probs.log()
    g = torch.Generator().manual_seed(0)
    tokens, logp = sample_tokens(logits, temperature=1.0, top_k=2, generator=g)
    assert set(tokens.tolist()) == {0, 1}
    torch.testing.assert_close(logp, probs.log().gather(1, tokens.unsqueeze(1)).squeeze(1))  # unfiltered logprob
    tokens, _ = sample_tokens(logits, temperature=1.0, top_p=0.45, generator=g)
    assert set(tokens.tolist()) == {0}
    tokens, _ = sample_tokens(logits, temperature=1.0, top_p=0.7, generator=g)
    assert set(tokens.tolist()) == {0, 1}
    tokens, _ = sample_tokens(logits, temperature=1.0, top_p=0.81, generator=g)
    assert set(tokens.tolist()) == {0, 1, 2}
    tokens, _ = sample_tokens(logits, temperature=1.0, generator=g)
    assert set(tokens.tolist()) == {0, 1, 2, 3}
    share = (tokens == 0).float().mean().item()
    assert 0.45 < share < 0.55


def _splitmix64_uniform(seed: int, counter: int) -> float:
    """The reference of docs' stream draw, in Python's unbounded ints: splitmix64 of ``seed`` stepped
    ``counter + 1`` times, its top 53 bits + 1/2 over 2^53."""
    m = 2**64 - 1
    z = (seed + (counter + 1) * 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    z ^= z >> 31
    return ((z >> 11) + 0.5) / 2**53


def test_stream_draws_are_splitmix64_of_the_seed_and_the_counter() -> None:
    seeds = [0, 1, 7, 2**62 + 3, -1, -(2**63), 2**63 - 1]
    counters = [0, 1, 2, 31, 1000, 2**40]
    pairs = [(s, c) for s in seeds for c in counters]
    got = stream_uniforms(torch.tensor([s for s, _ in pairs]), torch.tensor([c for _, c in pairs]))
    assert got.dtype == torch.float64
    assert got.tolist() == [_splitmix64_uniform(s % 2**64, c) for s, c in pairs]  # bit for bit
    # one stream's draws: in (0, 1), and uniform enough to sample with (mean and quartiles of 2^16)
    draws = stream_uniforms(torch.full((2**16,), 12345), torch.arange(2**16))
    assert draws.min() > 0.0 and draws.max() < 1.0
    assert abs(draws.mean().item() - 0.5) < 0.005
    assert all(abs((draws < q).double().mean().item() - q) < 0.01 for q in (0.25, 0.5, 0.75))
    # a named stream's seed, as docs/agents.md states it: BLAKE2b-64 of repr((parts)), little-endian, >> 1
    for parts in [(0, "w0-3", 2, 1), (17001, "a", 0, 0)]:
        digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
        assert stream_seed(*parts) == int.from_bytes(digest, "little") >> 1 < 2**63


def test_given_draws_pick_the_first_token_whose_cumulative_probability_reaches_them() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(5, 1)
    tokens, logp = sample_tokens(logits, temperature=1.0, uniforms=torch.tensor([0.2, 0.6, 0.85, 0.99, 0.45]))
    assert tokens.tolist() == [0, 1, 2, 3, 0]
    torch.testing.assert_close(logp, logits.log_softmax(-1).gather(1, tokens.unsqueeze(1)).squeeze(1))
    # the filters renormalise what the draw is scaled to: top_k 2 leaves [0.5, 0.3] -> 0.99 * 0.8 falls in token 1
    tokens, _ = sample_tokens(logits, temperature=1.0, top_k=2, uniforms=torch.full((5,), 0.99))
    assert tokens.tolist() == [1] * 5
    # a stream's draws sample the distribution
    many = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(8000, 1)
    tokens, _ = sample_tokens(many, temperature=1.0, uniforms=stream_uniforms(torch.full((8000,), 3), torch.arange(8000)))
    shares = torch.bincount(tokens, minlength=4).double() / 8000
    assert torch.allclose(shares, torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64), atol=0.02), shares


def test_inverse_transform_over_a_large_vocabulary_draws_the_distribution_and_never_a_zero() -> None:
    """The two-level draw (block sums, then inside the block) over 3000 entries: the same tokens as one
    cumulative sum over the row, its frequencies those of the distribution, and no token of
    probability 0 at any draw, the extreme ones included."""
    vocab = 3 * SAMPLE_BLOCK - 72  # a last block shorter than the others
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(16, vocab, generator=g) ** 8  # uneven, every entry > 0
    u = torch.rand(16 * 500, generator=g, dtype=torch.float64)
    rows = probs.repeat(500, 1)
    two_level = inverse_transform(rows, u)
    cdf = rows.to(torch.float64).cumsum(-1)
    one_level = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1)).squeeze(1)
    assert (two_level == one_level).double().mean() > 0.999  # apart only where the two round apart
    # a distribution of a few tokens across the blocks, zeros around them (a top-k mask)
    sparse = torch.zeros(vocab)
    sparse[[0, 5, SAMPLE_BLOCK - 1, SAMPLE_BLOCK, 2 * SAMPLE_BLOCK + 7, vocab - 1]] = torch.tensor(
        [0.1, 0.2, 0.05, 0.25, 0.3, 0.1])
    draws = torch.cat([torch.rand(20000, generator=g, dtype=torch.float64),
                       torch.tensor([2.0**-53, 1e-300, 1 - 2.0**-53, 0.5], dtype=torch.float64)])
    tokens = inverse_transform(sparse.repeat(len(draws), 1), draws)
    assert bool((sparse[tokens] > 0).all())
    shares = torch.bincount(tokens[:20000], minlength=vocab).double() / 20000
    want = sparse.double()
    assert torch.allclose(shares[want > 0], want[want > 0], atol=0.015), shares[want > 0]
    # a leading zero block and a row whose only mass is the last entry
    only_last = torch.zeros(2, vocab)
    only_last[0, -1] = 1.0
    only_last[1, SAMPLE_BLOCK + 3] = 1e-30
    assert inverse_transform(only_last, torch.tensor([1e-9, 0.999999], dtype=torch.float64)).tolist() == [
        vocab - 1, SAMPLE_BLOCK + 3]


def test_a_prompts_stream_gives_its_tokens_whatever_else_the_call_holds_and_however_it_is_split(
    model: torch.nn.Module, tok: PreTrainedTokenizerFast
) -> None:
    engine = _engine(model, tok)
    prompts = encode(tok, PROMPTS)
    streams = [(1000 + i, 0) for i in range(len(prompts))]
    together = [g.response_ids.tolist() for g in engine.generate(prompts, max_new_tokens=8, streams=streams)]
    assert together[0] != together[3]  # the same prompt twice, two streams: two draws
    alone = [engine.generate([p], max_new_tokens=8, streams=[s])[0].response_ids.tolist()
             for p, s in zip(prompts, streams, strict=True)]
    assert alone == together
    order = [4, 1, 5, 0, 3, 2]
    shuffled = engine.generate([prompts[i] for i in order], max_new_tokens=8, streams=[streams[i] for i in order])
    assert [g.response_ids.tolist() for g in shuffled] == [together[i] for i in order]
    # split into a call of 3 tokens and one that goes on from the completion so far, at draw 3
    first = engine.generate(prompts, max_new_tokens=3, streams=streams)
    going = [i for i, g in enumerate(first) if g.finish_reason == "length"]
    assert going
    rest = engine.generate([torch.cat([prompts[i], first[i].response_ids]) for i in going], max_new_tokens=5,
                           streams=[(streams[i][0], 3) for i in going])
    for i, g in zip(going, rest, strict=True):
        assert first[i].response_ids.tolist() + g.response_ids.tolist() == together[i]
    # without streams the call's rows share one generator: another batch, other tokens
    assert engine.generate(prompts, max_new_tokens=8, streams=[(7, 0)] * len(prompts))[1].response_ids.tolist() \
        == engine.generate([prompts[1]], max_new_tokens=8, streams=[(7, 0)])[0].response_ids.tolist()


def test_top_k_in_generation(model: torch.nn.Module, tok: PreTrainedTokenizerFast) -> None:
    prompts = encode(tok, PROMPTS)
    gens = _engine(model, tok).generate(prompts, max_new_tokens=6, top_k=2, temperature=0.9, seed=3)
    greedy = _engine(model, tok).generate(prompts, max_new_tokens=6, top_k=1, seed=4)
    with torch.no_grad():
        for p, g, gr in zip(prompts, gens, greedy, strict=True):
            logits = model(torch.cat([p, g.response_ids]).unsqueeze(0)).logits[0, len(p) - 1 : -1]
            top2 = logits.topk(2, dim=-1).indices
            assert all(int(t) in top2[i].tolist() for i, t in enumerate(g.response_ids))
            logits = model(torch.cat([p, gr.response_ids]).unsqueeze(0)).logits[0, len(p) - 1 : -1]
            assert torch.equal(logits.argmax(-1), gr.response_ids)


def test_weights_loaded_into_the_engine_are_used(model: torch.nn.Module, tok: PreTrainedTokenizerFast) -> None:
    engine = _engine(model, tok)
    prompts = encode(tok, PROMPTS)
    engine.load_state_dict(constant_model(tok, eos_logit=60.0).state_dict())
    assert all(g.response_ids.tolist() == [tok.eos_token_id] for g in engine.generate(prompts, max_new_tokens=4))


def test_an_install_copies_every_tensor_in_place_and_refuses_what_does_not_match(
        model: torch.nn.Module, tok: PreTrainedTokenizerFast) -> None:
    """The foreach install: the module's own tensors take the new values (the same objects, so a
    shared module sees them); a missing or extra name, or another shape, is torch's strict error."""
    engine = _engine(model, tok)
    own = engine.model.state_dict(keep_vars=True)
    new = {k: torch.randn_like(v) for k, v in own.items()}
    engine.load_state_dict(new)
    after = engine.model.state_dict(keep_vars=True)
    for k, v in after.items():
        assert v is own[k] and torch.equal(v, new[k]), k
    missing = dict(new)
    name = next(iter(missing))
    del missing[name]
    with pytest.raises(RuntimeError, match="Missing key"):
        engine.load_state_dict(missing)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        engine.load_state_dict({**new, "extra.weight": torch.zeros(1)})
    reshaped = {**new, name: torch.zeros(3, 3)}
    with pytest.raises(RuntimeError, match="size mismatch"):
        engine.load_state_dict(reshaped)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 4, "temperature": 0.0}, "temperature"),
        ({"max_new_tokens": 4, "top_p": 0.0}, "top_p"),
        ({"max_new_tokens": 4, "top_k": -1}, "top_k"),
    ],
)
def test_bad_arguments(model: torch.nn.Module, tok: PreTrainedTokenizerFast, kwargs: dict, needle: str) -> None:
    with pytest.raises(GenerateArgumentError, match=needle):
        _engine(model, tok).generate(encode(tok, ["1="]), **kwargs)


@pytest.mark.parametrize(("streams", "needle"), [([(1, 0)], "2 prompts"), ([(1, 0), (2,)], r"streams\[1\]"),
                                                 ([(1, 0), (2, -1)], "first draw"), ([(1, 0), (2**63, 0)], "int64")])
def test_bad_streams(model: torch.nn.Module, tok: PreTrainedTokenizerFast, streams: list, needle: str) -> None:
    with pytest.raises(GenerateArgumentError, match=needle):
        _engine(model, tok).generate(encode(tok, ["1=", "2="]), max_new_tokens=2, streams=streams)


def test_bad_prompts(model: torch.nn.Module, tok: PreTrainedTokenizerFast) -> None:
    engine = _engine(model, tok)
    with pytest.raises(GenerateArgumentError, match="empty"):
        engine.generate([], max_new_tokens=2)
    with pytest.raises(GenerateArgumentError, match=r"prompts\[1\] must be a non-empty 1-D int64"):
        engine.generate([torch.tensor([3, 4]), torch.tensor([1.0, 2.0])], max_new_tokens=2)
    with pytest.raises(GenerateArgumentError, match=r"prompts\[0\]"):
        engine.generate([torch.zeros(0, dtype=torch.int64)], max_new_tokens=2)


# -- an architecture outside the Llama family: GPT-2 on the Hugging Face path ---------------------
GPT2 = TinyModelSpec(arch="gpt2", hidden=32, layers=2, heads=4, intermediate=64, seed=3)
# Ragged lengths (2..12 tokens) and repeats (the shared-prompt expansion) in one batch.
GPT2_PROMPTS = ["1+2+3=", "45=", "9=", "1+2+3=", "7777777=", "45=", "123456789+1="]


@pytest.fixture
def gpt2(tok: PreTrainedTokenizerFast) -> PreTrainedModel:
    """A tiny GPT-2 whose greedy continuations depend on positions.

    At GPT-2's init (std 0.02) every prompt continues with the same token at every step, which
    would let a decoder with wrong position ids pass; redrawn at std 0.3 (LayerNorms kept), the
    continuations differ by prompt and step. Weights are written in place, so lm_head stays tied.
    """
    model = build_model(GPT2, tok).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".ln_" not in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.3)
    assert model.lm_head.weight is model.transformer.wte.weight
    return model


def test_forward_path_is_logged_once_with_its_reason(
    model: torch.nn.Module, gpt2: PreTrainedModel, tok: PreTrainedTokenizerFast, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="streamrl.engine.rollout"):
        assert _engine(model, tok).forward_path == "functional"
        assert _engine(model, tok, use_functional=False).forward_path == "hf"
        assert _engine(gpt2, tok).forward_path == "hf"
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "streamrl.engine.rollout"]
    assert lines[0] == (logging.INFO, "rollout forward: functional (qwen2)")
    forced = "rollout forward: Hugging Face module with KV cache (qwen2: use_functional=False)"
    assert lines[1] == (logging.INFO, forced)
    assert lines[2][0] == logging.INFO
    assert lines[2][1].startswith("rollout forward: Hugging Face module with KV cache (gpt2: model_type 'gpt2'")
    assert len(lines) == 3  # once per engine, at construction
    with pytest.raises(GenerateArgumentError, match="use_functional=True but model_type 'gpt2'"):
        _engine(gpt2, tok, use_functional=True)


@pytest.mark.parametrize("compact_below", [0.0, 0.75, 1.0])
def test_gpt2_greedy_equals_transformers_generate(
    gpt2: PreTrainedModel, tok: PreTrainedTokenizerFast, compact_below: float
) -> None:
    prompts = encode(tok, GPT2_PROMPTS)
    engine = _engine(gpt2, tok, compact_below=compact_below)
    gens = engine.generate(prompts, max_new_tokens=12, top_k=1, seed=0)
    for p, g in zip(prompts, gens, strict=True):
        # transformers' own greedy decoding, one unpadded prompt at a time: the oracle for positions
        expected = gpt2.generate(
            p.unsqueeze(0), attention_mask=torch.ones(1, p.numel(), dtype=torch.int64),
            max_new_tokens=12, do_sample=False,
        )[0, p.numel() :]
        assert g.response_ids.tolist() == expected.tolist(), tok.decode(p)
        assert g.finish_reason == ("eos" if expected[-1] == tok.eos_token_id else "length")
        with torch.no_grad():  # teacher-forced: one forward over prompt + response
            logits = gpt2(torch.cat([p, g.response_ids]).unsqueeze(0)).logits[0, p.numel() - 1 : -1]
        teacher = torch.log_softmax(logits, -1).gather(1, g.response_ids.unsqueeze(1)).squeeze(1)
        torch.testing.assert_close(g.logprobs, teacher, atol=1e-5, rtol=0.0)
    # The batch exercises what it should: different continuations, and both ways of finishing.
    assert len({tuple(g.response_ids.tolist()) for g in gens}) >= 4
    assert {g.finish_reason for g in gens} == {"eos", "length"}


def test_gpt2_sampled_logprobs_equal_the_logprob_engine_recomputation(
    gpt2: PreTrainedModel, tok: PreTrainedTokenizerFast
) -> None:
    prompts = encode(tok, GPT2_PROMPTS * 2)
    gens = _engine(gpt2, tok).generate(prompts, max_new_tokens=10, temperature=0.7, seed=2)
    recomputed = LogprobEngine(gpt2, device="cpu").logprobs(
        prompts, [g.response_ids for g in gens], temperature=0.7
    )
    for g, r in zip(gens, recomputed, strict=True):
        torch.testing.assert_close(g.logprobs, r, atol=1e-5, rtol=1e-5)


def test_gpt2_refuses_positions_past_its_learned_table(gpt2: PreTrainedModel, tok: PreTrainedTokenizerFast) -> None:
    engine = _engine(gpt2, tok)
    assert engine.position_table == GPT2.max_positions == 64
    prompt = [torch.tensor(tok("1" * 59 + "=")["input_ids"], dtype=torch.int64)]  # 60 tokens
    with pytest.raises(GenerateArgumentError, match=r"max_new_tokens=6 needs positions up to 64.*64 rows"):
        engine.generate(prompt, max_new_tokens=6)
    # 60 + 5: the last token fed sits at position 63, the table's last row.
    (g,) = engine.generate(prompt, max_new_tokens=5, top_k=1)
    assert 1 <= g.response_ids.numel() <= 5
    assert _engine(build_model(TINY, tok), tok).position_table is None  # RoPE: no table to run past
