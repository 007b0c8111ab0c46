"""The torch rollout engine: stopping, logprobs, sampling filters, determinism, errors."""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from streamrl.engines.rollout import GenerateArgumentError, TorchRolloutEngine, sample_tokens
from streamrl.engines.train import TorchTrainEngine
from tests.engines.conftest import constant_model, encode

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
def test_logprobs_equal_the_train_engine_recomputation(
    model: torch.nn.Module, tok: PreTrainedTokenizerFast, use_functional: bool, temperature: float
) -> None:
    prompts = encode(tok, PROMPTS * 2)
    gens = _engine(model, tok, use_functional=use_functional).generate(
        prompts, max_new_tokens=10, temperature=temperature, seed=2
    )
    trainer = TorchTrainEngine(model, lr=1e-3, device="cpu")
    recomputed = trainer.logprobs(prompts, [g.response_ids for g in gens], temperature=temperature)
    for g, r in zip(gens, recomputed, strict=True):
        torch.testing.assert_close(g.logprobs, r, atol=1e-5, rtol=1e-5)
    # And against the plain HF forward, token by token.
    with torch.no_grad():
        for p, g in zip(prompts, gens, strict=True):
            logits = model(torch.cat([p, g.response_ids]).unsqueeze(0)).logits[0, len(p) - 1 : -1]
            expected = torch.log_softmax(logits / temperature, -1).gather(1, g.response_ids.unsqueeze(1)).squeeze(1)
            torch.testing.assert_close(g.logprobs, expected, atol=1e-5, rtol=1e-5)


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


def test_bad_prompts(model: torch.nn.Module, tok: PreTrainedTokenizerFast) -> None:
    engine = _engine(model, tok)
    with pytest.raises(GenerateArgumentError, match="empty"):
        engine.generate([], max_new_tokens=2)
    with pytest.raises(GenerateArgumentError, match=r"prompts\[1\] must be a non-empty 1-D int64"):
        engine.generate([torch.tensor([3, 4]), torch.tensor([1.0, 2.0])], max_new_tokens=2)
    with pytest.raises(GenerateArgumentError, match=r"prompts\[0\]"):
        engine.generate([torch.zeros(0, dtype=torch.int64)], max_new_tokens=2)
