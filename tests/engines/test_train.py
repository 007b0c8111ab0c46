"""The train engine: streamed accumulation equals the whole batch, steps, checkpoints, errors."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from streamrl.algos.grpo import LossConfig, aggregate_loss, per_token_loss
from streamrl.engines.train import (
    NothingAccumulatedError,
    TorchLogprobEngine,
    TorchTrainEngine,
    TrainBatchError,
    TrainSample,
    samples_from_columns,
)
from tests.engines.conftest import encode

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]


def _batch(tok: PreTrainedTokenizerFast, seed: int = 0, with_ref: bool = True) -> list[TrainSample]:
    """Two groups of 3 (shared prompts), ragged responses, one empty, off-policy logprobs."""
    g = torch.Generator().manual_seed(seed)
    prompts = encode(tok, ["1+2+3=", "1+2+3=", "1+2+3=", "98=", "98=", "98="])
    lengths = [4, 1, 6, 3, 0, 5]
    out = []
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        resp = torch.randint(3, 15, (n,), generator=g)
        if n:
            resp[-1] = tok.eos_token_id
        noise = torch.randn(3, n, generator=g) * 0.3 - 2.0
        out.append(TrainSample(
            p, resp, advantage=float(i) - 2.5, rollout_logprobs=noise[0], old_logprobs=noise[1],
            ref_logprobs=noise[2] if with_ref else None,
        ))
    return out


def _captured_grads(engine: TorchTrainEngine) -> dict[str, torch.Tensor]:
    """Gradients as the optimizer sees them at the step (normalised, clipping off in these tests)."""
    grads: dict[str, torch.Tensor] = {}
    names = {id(p): n for n, p in engine.model.named_parameters()}

    def hook(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    grads[names[id(p)]] = p.grad.clone()

    engine.optimizer.register_step_pre_hook(hook)
    return grads


def _reference_grads(model: torch.nn.Module, batch: list[TrainSample], cfg: LossConfig) -> dict[str, torch.Tensor]:
    """The whole batch at once with the plain HF forward, one sequence at a time."""
    model = copy.deepcopy(model)
    logps, seq_index = [], []
    for i, s in enumerate(batch):
        full = torch.cat([s.prompt_ids, s.response_ids]).unsqueeze(0)
        logits = model(full).logits[0, s.prompt_ids.numel() - 1 : -1] / cfg.temperature
        logps.append(torch.log_softmax(logits, -1).gather(1, s.response_ids.unsqueeze(1)).squeeze(1))
        seq_index += [i] * s.response_ids.numel()

    def cat(name: str) -> torch.Tensor | None:
        return None if getattr(batch[0], name) is None else torch.cat([getattr(s, name) for s in batch])

    adv = torch.tensor([s.advantage for s in batch])[torch.tensor(seq_index)]
    per_token, _ = per_token_loss(torch.cat(logps), adv, cfg, old_logprobs=cat("old_logprobs"),
                                  rollout_logprobs=cat("rollout_logprobs"), ref_logprobs=cat("ref_logprobs"))
    aggregate_loss(per_token, torch.tensor(seq_index), len(batch), cfg.loss_agg).backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", MODES)
def test_streamed_gradient_equals_the_whole_batch_for_any_split(
    model: torch.nn.Module, tok: PreTrainedTokenizerFast, mode: str
) -> None:
    cfg = LossConfig(loss_agg=mode, kl_coef=0.05, temperature=0.8)  # type: ignore[arg-type]
    batch = _batch(tok)
    expected = _reference_grads(model, batch, cfg)
    for split in ([6], [2, 1, 3], [1] * 6):
        engine = TorchTrainEngine(copy.deepcopy(model), lr=1e-3, max_grad_norm=None, device="cpu")
        grads = _captured_grads(engine)
        start = 0
        for n in split:
            engine.accumulate(batch[start : start + n], cfg)
            start += n
        stats = engine.step()
        assert stats["tokens"] == 19 and stats["sequences"] == 6 and stats["micro_batches"] == len(split)
        for name, g in expected.items():
            torch.testing.assert_close(grads[name], g, atol=1e-5, rtol=1e-4, msg=f"{mode} {split} {name}")


def test_hf_fallback_gives_the_same_gradients(model: torch.nn.Module, tok: PreTrainedTokenizerFast) -> None:
    cfg = LossConfig(kl_coef=0.1)
    batch = _batch(tok, seed=1)
    results = []
    for use_functional in (True, False):
        engine = TorchTrainEngine(copy.deepcopy(model), lr=1e-3, max_grad_norm=None, device="cpu",
                                  use_functional=use_functional)
        assert (engine.fn is not None) == use_functional
        grads = _captured_grads(engine)
        engine.accumulate(batch, cfg)
        engine.step()
        results.append(grads)
    for name, g in results[0].items():
        torch.testing.assert_close(g, results[1][name], atol=1e-5, rtol=1e-4, msg=name)


def test_step_updates_weights_clips_and_resets(model: torch.nn.Module, tok: PreTrainedTokenizerFast) -> None:
    engine = TorchTrainEngine(model, lr=1e-2, max_grad_norm=1e-3, device="cpu")
    before = engine.state_dict()
    with pytest.raises(NothingAccumulatedError):
        engine.step()
    micro = engine.accumulate(_batch(tok), LossConfig())
    assert set(micro) >= {"loss", "tokens", "sequences", "clip_fraction", "entropy"}
    assert engine.pending() == {"tokens": 19, "sequences": 6, "micro_batches": 1}
    stats = engine.step()
    assert stats["grad_norm"] > 1e-3  # reported before clipping
    assert all(p.grad is None for p in engine.params)  # gradients are dropped after the step
    assert stats["step"] == 1.0 and stats["lr"] == 1e-2 and stats["is_weight"] > 0
    after = engine.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert engine.pending() == {"tokens": 0, "sequences": 0, "micro_batches": 0}
    engine.accumulate(_batch(tok), LossConfig())
    with pytest.raises(ValueError, match="loss_agg changed"):
        engine.accumulate(_batch(tok), LossConfig(loss_agg="seq-mean-token-sum"))


def test_global_denominator_override(model: torch.nn.Module, tok: PreTrainedTokenizerFast) -> None:
    """Two data-parallel ranks with half the batch each: local sums / global count = whole batch."""
    batch = _batch(tok)
    whole = TorchTrainEngine(copy.deepcopy(model), lr=1e-3, max_grad_norm=None, device="cpu")
    g_whole = _captured_grads(whole)
    whole.accumulate(batch, LossConfig())
    whole.step()
    ranks = [TorchTrainEngine(copy.deepcopy(model), lr=1e-3, max_grad_norm=None, device="cpu") for _ in range(2)]
    captured = [_captured_grads(r) for r in ranks]
    for r, part in zip(ranks, (batch[:2], batch[2:]), strict=True):
        r.accumulate(part, LossConfig())
    total_tokens = sum(r.pending()["tokens"] for r in ranks)
    for r in ranks:
        r.step(global_tokens=total_tokens)
    for name, g in g_whole.items():
        torch.testing.assert_close(captured[0][name] + captured[1][name], g, atol=1e-6, rtol=1e-4)


def test_checkpoint_reloads_through_transformers(
    model: torch.nn.Module, tok: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    engine = TorchTrainEngine(model, lr=1e-2, device="cpu")
    engine.accumulate(_batch(tok), LossConfig())
    engine.step()
    engine.save_checkpoint(tmp_path / "ckpt", tok)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", local_files_only=True)
    tok2 = AutoTokenizer.from_pretrained(tmp_path / "ckpt")
    assert tok2("1+2=")["input_ids"] == tok("1+2=")["input_ids"]
    ids = torch.tensor([tok("1+2+3=45")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_state_dict_roundtrip_and_copy(model: torch.nn.Module, tok: PreTrainedTokenizerFast) -> None:
    engine = TorchTrainEngine(model, lr=1e-2, device="cpu")
    snapshot = engine.state_dict()
    live = engine.state_dict(copy=False)
    engine.accumulate(_batch(tok), LossConfig())
    engine.step()
    name = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(snapshot[name], engine.model.state_dict()[name])  # the copy did not move
    assert torch.equal(live[name], engine.model.state_dict()[name])  # the view did
    engine.load_state_dict(snapshot)
    assert torch.equal(engine.model.state_dict()[name], snapshot[name])
    with pytest.raises(RuntimeError, match="Missing key"):
        engine.load_state_dict({})


def test_logprobs_match_the_hf_forward(model: torch.nn.Module, tok: PreTrainedTokenizerFast) -> None:
    engine = TorchTrainEngine(model, lr=1e-3, device="cpu")
    batch = _batch(tok)
    got = engine.logprobs([s.prompt_ids for s in batch], [s.response_ids for s in batch], temperature=1.0)
    assert [g.numel() for g in got] == [4, 1, 6, 3, 0, 5]
    with torch.no_grad():
        for s, g in zip(batch, got, strict=True):
            if s.response_ids.numel() == 0:
                continue
            logits = model(torch.cat([s.prompt_ids, s.response_ids]).unsqueeze(0)).logits[0, len(s.prompt_ids) - 1 : -1]
            expected = torch.log_softmax(logits, -1).gather(1, s.response_ids.unsqueeze(1)).squeeze(1)
            torch.testing.assert_close(g, expected, atol=1e-5, rtol=1e-5)
    assert engine.logprobs([], []) == []


def test_bad_samples_name_the_sample_and_field(model: torch.nn.Module, tok: PreTrainedTokenizerFast) -> None:
    engine = TorchTrainEngine(model, lr=1e-3, device="cpu")
    good = _batch(tok)
    bad = TrainSample(good[1].prompt_ids, good[1].response_ids, 0.0, rollout_logprobs=torch.zeros(5))
    with pytest.raises(TrainBatchError, match="sample 1: rollout_logprobs must be a 1-D float tensor with one value"):
        engine.accumulate([good[0], bad], LossConfig())
    with pytest.raises(TrainBatchError, match="sample 0: response_ids must be a 1-D int64"):
        engine.accumulate([TrainSample(good[0].prompt_ids, torch.zeros(3), 1.0)], LossConfig())
    with pytest.raises(TrainBatchError, match="ref_logprobs is given for some samples"):
        engine.accumulate([good[0], _batch(tok, with_ref=False)[1]], LossConfig())
    with pytest.raises(TrainBatchError, match="empty micro-batch"):
        engine.accumulate([], LossConfig())
    with pytest.raises(ValueError, match="ref_logprobs"):
        engine.accumulate(_batch(tok, with_ref=False), LossConfig(kl_coef=0.1))


def test_samples_from_columns(tok: PreTrainedTokenizerFast) -> None:
    batch = _batch(tok, with_ref=False)
    cols = {
        "prompt_ids": [s.prompt_ids for s in batch],
        "response_ids": [s.response_ids for s in batch],
        "advantage": [s.advantage for s in batch],
        "rollout_logprobs": [s.rollout_logprobs for s in batch],
        "reward": [0.0] * len(batch),  # other columns are ignored
    }
    samples = samples_from_columns(cols)
    assert [s.advantage for s in samples] == [s.advantage for s in batch]
    assert samples[0].old_logprobs is None and samples[0].ref_logprobs is None
    with pytest.raises(TrainBatchError, match="column 'advantage' is missing"):
        samples_from_columns({k: v for k, v in cols.items() if k != "advantage"})
    with pytest.raises(TrainBatchError, match="column 'advantage' has 1 values"):
        samples_from_columns({**cols, "advantage": [1.0]})


def test_zero_advantage_samples_are_counted_not_computed(model: torch.nn.Module, tok: PreTrainedTokenizerFast) -> None:
    """Without KL, a zero advantage has zero gradient: skipping it keeps the exact whole-batch gradient."""
    batch = [TrainSample(s.prompt_ids, s.response_ids, 0.0 if i in (0, 1, 4) else s.advantage, s.rollout_logprobs,
                         s.old_logprobs, None) for i, s in enumerate(_batch(tok))]
    for mode in MODES:
        cfg = LossConfig(loss_agg=mode)  # type: ignore[arg-type]
        expected = _reference_grads(model, batch, cfg)
        engine = TorchTrainEngine(copy.deepcopy(model), lr=1e-3, max_grad_norm=None, device="cpu")
        grads = _captured_grads(engine)
        first = engine.accumulate(batch[:2], cfg)  # both zero: nothing to compute
        assert first["skipped_sequences"] == 2 and first["tokens"] == 5
        engine.accumulate(batch[2:], cfg)
        assert engine.pending() == {"tokens": 19, "sequences": 6, "micro_batches": 2}
        stats = engine.step()
        assert stats["skipped_sequences"] == 3 and stats["tokens"] == 19 and stats["sequences"] == 6
        for name, g in expected.items():
            torch.testing.assert_close(grads[name], g, atol=1e-5, rtol=1e-4, msg=f"{mode} {name}")


def test_frozen_model_scores_but_does_not_train(model: torch.nn.Module, tok: PreTrainedTokenizerFast) -> None:
    """The reference stage's case: a frozen policy only gives logprobs."""
    batch = _batch(tok)
    prompts, responses = [s.prompt_ids for s in batch], [s.response_ids for s in batch]
    expected = TorchTrainEngine(model, lr=1e-3, device="cpu").logprobs(prompts, responses)
    model.requires_grad_(False)
    for engine in (TorchLogprobEngine(model, device="cpu"), TorchTrainEngine(model, lr=1.0, device="cpu")):
        for got, want in zip(engine.logprobs(prompts, responses), expected, strict=True):
            torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="no trainable parameters"):
        TorchTrainEngine(model, lr=1.0, device="cpu").accumulate(batch, LossConfig())
