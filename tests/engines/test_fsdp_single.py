"""The FSDP2 train engine at R=1 in the pytest process: streamed accumulation equals the whole batch,
steps, export, logprobs, errors.

A gloo world of one (``world_of_one``) is initialised for this module and destroyed after it. The
reference is the plain Hugging Face forward of an unsharded copy of the model, one sequence at a
time; the engine computes on shared-prompt rows (``forward_path`` "packed") or, with
``pack_prompts`` off, on right-padded rows: both must give it.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from streamrl.algos.grpo import LossConfig, aggregate_loss, per_token_loss
from streamrl.engines.fsdp import FSDPOptions, FSDPTrainEngine
from streamrl.engines.logprob import LogprobEngine
from streamrl.engines.samples import (
    NothingAccumulatedError,
    TrainBatchError,
    TrainSample,
    check_sample,
    samples_from_columns,
)
from tests.engines.conftest import encode

pytestmark = pytest.mark.usefixtures("world_of_one")

# the built-ins and a user's aggregation (module:function): the engine streams whichever is named
MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "tests.algos.user_algos:sqrt_length"]
PACKED = FSDPOptions()
PADDED = FSDPOptions(pack_prompts=False)


def _batch(tok: PreTrainedTokenizerFast, seed: int = 0, with_ref: bool = True) -> list[TrainSample]:
    """Two groups of 3 (shared prompts of different lengths), ragged responses, one of 1 token, one
    empty, off-policy logprobs."""
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


def _engine(model: torch.nn.Module, *, lr: float = 1e-3, max_grad_norm: float | None = None,
            options: FSDPOptions = PACKED) -> FSDPTrainEngine:
    """An engine on a copy of ``model`` (the engine shards its module in place)."""
    engine = FSDPTrainEngine(copy.deepcopy(model), lr=lr, max_grad_norm=max_grad_norm, device="cpu",
                             options=options)
    assert engine.forward_path == ("packed" if options.pack_prompts else "padded")
    return engine


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _captured_grads(engine: FSDPTrainEngine) -> dict[str, torch.Tensor]:
    """Gradients as the optimizer sees them at the step (normalised; clipping off in these tests)."""
    grads: dict[str, torch.Tensor] = {}
    names = {id(p): n for n, p in engine.model.named_parameters()}

    def hook(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    grads[names[id(p)]] = _full(p.grad).clone()

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
    per_token, _ = per_token_loss(torch.cat(logps), adv, cfg, seq_index=torch.tensor(seq_index),
                                  old_logprobs=cat("old_logprobs"), rollout_logprobs=cat("rollout_logprobs"),
                                  ref_logprobs=cat("ref_logprobs"))
    aggregate_loss(per_token, torch.tensor(seq_index), len(batch), cfg.loss_agg, cfg.norm_tokens or 1).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _reference_logprobs(model: torch.nn.Module, batch: list[TrainSample]) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for s in batch:
            full = torch.cat([s.prompt_ids, s.response_ids]).unsqueeze(0)
            logits = model(full).logits[0, s.prompt_ids.numel() - 1 : -1]
            out.append(torch.log_softmax(logits, -1).gather(1, s.response_ids.unsqueeze(1)).squeeze(1))
    return out


@pytest.mark.parametrize("options", [PACKED, PADDED], ids=["packed", "padded"])
@pytest.mark.parametrize("mode", MODES)
def test_streamed_gradient_equals_the_whole_batch_for_any_split(
    model: torch.nn.Module, tok: PreTrainedTokenizerFast, mode: str, options: FSDPOptions
) -> None:
    cfg = LossConfig(loss_agg=mode, kl_coef=0.05, temperature=0.8)  # type: ignore[arg-type]
    batch = _batch(tok)
    expected = _reference_grads(model, batch, cfg)
    for split in ([6], [2, 1, 3], [1] * 6):
        engine = _engine(model, options=options)
        grads = _captured_grads(engine)
        start = 0
        for n in split:
            engine.accumulate(batch[start : start + n], cfg)
            start += n
        stats = engine.step()
        assert stats["tokens"] == 19 and stats["sequences"] == 6 and stats["micro_batches"] == len(split)
        assert grads.keys() == expected.keys()
        for name, g in expected.items():
            torch.testing.assert_close(grads[name], g, atol=1e-5, rtol=1e-4, msg=f"{mode} {split} {name}")


@pytest.mark.parametrize("cfg", [
    LossConfig(policy_loss="ppo_clip", dual_clip=1.5, clip_high=0.28, correction="mis", is_cap=1.2),
    LossConfig(policy_loss="gspo", clip_low=0.05, clip_high=0.08, loss_agg="seq-mean-token-mean"),
    LossConfig(policy_loss="cispo", clip_low=1.0, clip_high=0.1, loss_agg="seq-mean-token-sum-norm", norm_tokens=7),
], ids=["ppo_clip-dual-mis", "gspo", "cispo-norm"])
def test_every_policy_loss_streams_exactly(model: torch.nn.Module, tok: PreTrainedTokenizerFast,
                                           cfg: LossConfig) -> None:
    """The trainer calls the configured loss, correction and aggregation by name, and the streamed
    gradient equals the whole batch's for each (GSPO's sequence-level ratio included)."""
    batch = _batch(tok)
    expected = _reference_grads(model, batch, cfg)
    engine = _engine(model)
    grads = _captured_grads(engine)
    for part in (batch[:2], batch[2:3], batch[3:]):
        engine.accumulate(part, cfg)
    engine.step()
    for name, g in expected.items():
        torch.testing.assert_close(grads[name], g, atol=1e-5, rtol=1e-4, msg=f"{cfg.policy_loss} {name}")
    assert any(float(g.abs().max()) > 0 for g in expected.values())


def _masked(batch: list[TrainSample], seed: int = 1) -> list[TrainSample]:
    """The batch as multi-turn trajectories: per-token advantages, and a loss mask that leaves out
    some tokens of each response (the first token of every response of >= 2 tokens, and every
    third token), as tool output between generated segments would be."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in batch:
        n = s.response_ids.numel()
        mask = torch.ones(n)
        mask[::3] = 0.0
        if n == 1:
            mask[0] = 1.0
        out.append(dataclasses.replace(s, advantage=torch.randn(n, generator=g), loss_mask=mask))
    return out


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_a_loss_mask_and_per_token_advantages_train_only_the_sampled_tokens(
    model: torch.nn.Module, tok: PreTrainedTokenizerFast, mode: str
) -> None:
    """Masked tokens are out of the loss and of its denominators: the gradient equals the whole
    batch's loss over the kept tokens only, each with its own advantage."""
    cfg = LossConfig(loss_agg=mode, kl_coef=0.05)  # type: ignore[arg-type]
    batch = _masked(_batch(tok))
    ref = copy.deepcopy(model)
    logps, seq_index = [], []
    for i, s in enumerate(batch):
        full = torch.cat([s.prompt_ids, s.response_ids]).unsqueeze(0)
        logits = ref(full).logits[0, s.prompt_ids.numel() - 1 : -1]
        logps.append(torch.log_softmax(logits, -1).gather(1, s.response_ids.unsqueeze(1)).squeeze(1))
        seq_index += [i] * s.response_ids.numel()
    keep = torch.cat([s.loss_mask for s in batch]).bool()

    def cat(name: str) -> torch.Tensor:
        return torch.cat([getattr(s, name) for s in batch])[keep]

    per_token, _ = per_token_loss(torch.cat(logps)[keep], cat("advantage"), cfg,
                                  seq_index=torch.tensor(seq_index)[keep], old_logprobs=cat("old_logprobs"),
                                  rollout_logprobs=cat("rollout_logprobs"), ref_logprobs=cat("ref_logprobs"))
    aggregate_loss(per_token, torch.tensor(seq_index)[keep], len(batch), cfg.loss_agg).backward()
    engine = _engine(model)
    grads = _captured_grads(engine)
    engine.accumulate(batch[:2], cfg)
    engine.accumulate(batch[2:], cfg)
    stats = engine.step()
    assert stats["tokens"] == int(keep.sum()) < 19 and stats["sequences"] == 6
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-5, rtol=1e-4, msg=f"{mode} {name}")


def test_the_entropy_bonus_trains_on_the_entropy(model: torch.nn.Module, tok: PreTrainedTokenizerFast) -> None:
    """entropy_coef > 0: the loss is minus coef x each token's entropy, whose gradient flows; zero-
    advantage samples are then computed too (their entropy term has a gradient)."""
    cfg = LossConfig(entropy_coef=0.3, temperature=0.8)
    batch = [dataclasses.replace(s, advantage=0.0 if i == 0 else s.advantage) for i, s in enumerate(_batch(tok))]
    ref = copy.deepcopy(model)
    logps, ents, seq_index = [], [], []
    for i, s in enumerate(batch):
        full = torch.cat([s.prompt_ids, s.response_ids]).unsqueeze(0)
        logits = ref(full).logits[0, s.prompt_ids.numel() - 1 : -1] / cfg.temperature
        logp_all = torch.log_softmax(logits, -1)
        logps.append(logp_all.gather(1, s.response_ids.unsqueeze(1)).squeeze(1))
        ents.append(-(logp_all.exp() * logp_all).sum(-1))
        seq_index += [i] * s.response_ids.numel()

    def cat(name: str) -> torch.Tensor:
        return torch.cat([getattr(s, name) for s in batch])

    adv = torch.cat([s.token_advantages() for s in batch])
    per_token, _ = per_token_loss(torch.cat(logps), adv, cfg, seq_index=torch.tensor(seq_index),
                                  entropy=torch.cat(ents), old_logprobs=cat("old_logprobs"),
                                  rollout_logprobs=cat("rollout_logprobs"), ref_logprobs=cat("ref_logprobs"))
    aggregate_loss(per_token, torch.tensor(seq_index), len(batch), cfg.loss_agg).backward()
    engine = _engine(model)
    grads = _captured_grads(engine)
    engine.accumulate(batch[:3], cfg)
    engine.accumulate(batch[3:], cfg)
    stats = engine.step()
    assert stats["skipped_sequences"] == 0
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)
    with pytest.raises(ValueError, match="entropy_coef"):
        LossConfig(entropy_coef=-1.0)


def test_a_constant_per_token_advantage_equals_the_sequence_advantage(
    model: torch.nn.Module, tok: PreTrainedTokenizerFast
) -> None:
    batch = _batch(tok)
    per_token = [dataclasses.replace(s, advantage=torch.full((s.response_ids.numel(),), float(s.advantage)),
                                     loss_mask=torch.ones(s.response_ids.numel())) for s in batch]
    seen = []
    for b in (batch, per_token):
        engine = _engine(model)
        grads = _captured_grads(engine)
        engine.accumulate(b, LossConfig())
        engine.step()
        seen.append(grads)
    for name, g in seen[0].items():
        torch.testing.assert_close(seen[1][name], g, atol=1e-6, rtol=1e-5)


def test_a_malformed_loss_mask_or_per_token_advantage_is_named(tok: PreTrainedTokenizerFast) -> None:
    s = _batch(tok)[0]  # 4 response tokens
    for bad, needle in [(dataclasses.replace(s, loss_mask=torch.ones(3)), "loss_mask must be a 1-D tensor"),
                        (dataclasses.replace(s, loss_mask=torch.full((4,), 0.5)), "only 0 and 1"),
                        (dataclasses.replace(s, advantage=torch.ones(5)), "per-token advantage"),
                        (dataclasses.replace(s, advantage=torch.tensor([1.0, float("nan"), 0.0, 0.0])), "non-finite")]:
        with pytest.raises(TrainBatchError, match=needle):
            check_sample(0, bad)


def test_step_updates_weights_clips_and_resets(model: torch.nn.Module, tok: PreTrainedTokenizerFast) -> None:
    engine = _engine(model, lr=1e-2, max_grad_norm=1e-3)
    before = engine.full_state_dict()
    saved = {k: v.clone() for k, v in before.items()}
    with pytest.raises(NothingAccumulatedError):
        engine.step()
    micro = engine.accumulate(_batch(tok), LossConfig())
    assert set(micro) >= {"loss", "tokens", "sequences", "clip_fraction", "entropy"}
    assert engine.pending() == {"tokens": 19, "sequences": 6, "micro_batches": 1}
    stats = engine.step()
    assert stats["grad_norm"] > 1e-3  # reported before clipping
    assert all(p.grad is None for p in engine.params)  # gradients are dropped after the step
    assert stats["step"] == 1.0 and stats["lr"] == 1e-2 and stats["is_weight"] > 0
    after = engine.full_state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], saved[k]) for k in before)  # a snapshot: the step did not move it
    assert any(not torch.equal(before[k], after[k]) for k in before)
    # clipped to norm 1e-3, Adam's first step moves each weight by about lr: nothing moves by far more
    assert max((before[k] - after[k]).abs().max().item() for k in before) <= 1.1e-2
    assert engine.pending() == {"tokens": 0, "sequences": 0, "micro_batches": 0}
    engine.set_lr(5e-3)
    engine.accumulate(_batch(tok), LossConfig())
    with pytest.raises(ValueError, match="loss_agg changed"):
        engine.accumulate(_batch(tok), LossConfig(loss_agg="seq-mean-token-sum"))
    assert engine.step()["lr"] == 5e-3
    engine.accumulate(_batch(tok), LossConfig())
    engine.zero_grad()  # drops the gradients and counts without stepping
    assert engine.pending() == {"tokens": 0, "sequences": 0, "micro_batches": 0}
    assert all(p.grad is None for p in engine.params)
    with pytest.raises(NothingAccumulatedError):
        engine.step()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_rank_trains_unwrapped_and_equals_fsdp2_bit_for_bit(
    model: torch.nn.Module, tok: PreTrainedTokenizerFast, dtype: str
) -> None:
    """At one rank the module is trained as it is (FSDP2 would only copy there), and its updates,
    statistics and reshard layout are those of the FSDP2-wrapped module exactly; in bfloat16 too,
    each forward on the float32 weights cast as FSDP2's MixedPrecisionPolicy casts them."""
    from streamrl.reshard.fsdp_layout import train_tp_dims
    from streamrl.reshard.layout import TrainLayout

    plain = _engine(model, max_grad_norm=0.5, options=FSDPOptions(dtype=dtype))
    wrapped = _engine(model, max_grad_norm=0.5, options=FSDPOptions(dtype=dtype, wrap_single_rank=True))
    assert not plain.wrapped and wrapped.wrapped
    assert not any(isinstance(p, DTensor) for p in plain.model.parameters())
    assert all(isinstance(p, DTensor) for p in wrapped.model.parameters())
    layout, dims = train_tp_dims(plain.model)
    assert layout == TrainLayout(1, 1) and set(dims.values()) == {None}
    assert train_tp_dims(wrapped.model)[0] == layout
    reference = _engine(model, max_grad_norm=0.5) if dtype != "float32" else None
    for step in range(3):
        batch = _batch(tok, seed=step)
        for engine in (plain, wrapped) if reference is None else (plain, wrapped, reference):
            engine.accumulate(batch[:3], LossConfig())
            engine.accumulate(batch[3:], LossConfig())
        stats = plain.step()
        assert stats == wrapped.step()
        if reference is not None:
            assert stats["loss"] != reference.step()["loss"]  # it computed in bfloat16, not float32
    got, expected = plain.full_state_dict(), wrapped.full_state_dict()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=0, rtol=0)
    for name, t in plain.local_shards().items():
        assert t.shape == expected[name].shape  # the reshard's input: each parameter whole


def test_clipping_scales_the_gradient_to_max_grad_norm(model: torch.nn.Module, tok: PreTrainedTokenizerFast) -> None:
    free = _engine(model)
    g_free = _captured_grads(free)
    free.accumulate(_batch(tok), LossConfig())
    norm = free.step()["grad_norm"]
    whole = torch.cat([g.flatten() for g in g_free.values()]).norm().item()
    assert norm == pytest.approx(whole, rel=1e-5)
    clipped = _engine(model, max_grad_norm=norm / 4)
    g_clipped = _captured_grads(clipped)
    clipped.accumulate(_batch(tok), LossConfig())
    assert clipped.step()["grad_norm"] == pytest.approx(norm, rel=1e-6)  # before clipping
    for name, g in g_free.items():
        torch.testing.assert_close(g_clipped[name], g / 4, atol=1e-7, rtol=1e-5, msg=name)


def test_global_denominator_override(model: torch.nn.Module, tok: PreTrainedTokenizerFast) -> None:
    """Two data-parallel ranks with half the batch each: local sums / global count = whole batch."""
    batch = _batch(tok)
    for mode in MODES:
        cfg = LossConfig(loss_agg=mode)  # type: ignore[arg-type]
        whole = _engine(model)
        g_whole = _captured_grads(whole)
        whole.accumulate(batch, cfg)
        whole.step()
        ranks = [_engine(model) for _ in range(2)]
        captured = [_captured_grads(r) for r in ranks]
        for r, part in zip(ranks, (batch[:2], batch[2:]), strict=True):
            r.accumulate(part, cfg)
        total_tokens = sum(r.pending()["tokens"] for r in ranks)
        total_seqs = sum(r.pending()["sequences"] for r in ranks)
        for r in ranks:
            r.step(global_tokens=total_tokens, global_sequences=total_seqs)
        for name, g in g_whole.items():
            torch.testing.assert_close(captured[0][name] + captured[1][name], g, atol=1e-6, rtol=1e-4,
                                       msg=f"{mode} {name}")


def test_export_pretrained_reloads_through_transformers(
    model: torch.nn.Module, tok: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    engine = _engine(model, lr=1e-2, max_grad_norm=1.0)
    engine.accumulate(_batch(tok), LossConfig())
    engine.step()
    assert engine.export_pretrained(tmp_path / "ckpt", tok) == tmp_path / "ckpt"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", local_files_only=True)
    tok2 = AutoTokenizer.from_pretrained(tmp_path / "ckpt")
    assert tok2("1+2=")["input_ids"] == tok("1+2=")["input_ids"]
    trained = engine.full_state_dict()
    reloaded = loaded.state_dict()
    assert reloaded.keys() == trained.keys()
    for name, t in trained.items():
        assert torch.equal(reloaded[name], t), name
    assert any(not torch.equal(t, model.state_dict()[name]) for name, t in trained.items())  # it trained
    ids = torch.tensor([tok("1+2+3=45")["input_ids"]])
    engine.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, engine.model(ids).logits)
    engine.export_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    half = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", local_files_only=True, dtype="auto")
    assert half.dtype == torch.bfloat16
    name = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(half.state_dict()[name], trained[name].to(torch.bfloat16))


@pytest.mark.parametrize("options", [PACKED, PADDED], ids=["packed", "padded"])
def test_logprobs_match_the_hf_forward(
    model: torch.nn.Module, tok: PreTrainedTokenizerFast, options: FSDPOptions
) -> None:
    engine = _engine(model, options=options)
    batch = _batch(tok)
    prompts, responses = [s.prompt_ids for s in batch], [s.response_ids for s in batch]
    got = engine.logprobs(prompts, responses, temperature=1.0)
    assert [g.numel() for g in got] == [4, 1, 6, 3, 0, 5]
    assert all(g.dtype == torch.float32 for g in got)
    for g, expected in zip(got, _reference_logprobs(model, batch), strict=True):
        torch.testing.assert_close(g, expected, atol=1e-5, rtol=1e-5)
    hot = engine.logprobs(prompts, responses, temperature=2.0)
    assert not torch.allclose(torch.cat(hot), torch.cat(got))
    assert engine.logprobs([], []) == []
    assert engine.model.training  # logprobs puts the module back as it found it
    with pytest.raises(TrainBatchError, match="6 prompts but 5 responses"):
        engine.logprobs(prompts, responses[:5])


def test_a_no_grad_forward_leaves_the_parameters_sharded(model: torch.nn.Module, tok: PreTrainedTokenizerFast) -> None:
    """Hazard: without a backward, FSDP2 keeps the root's gathered parameters (at one rank, every
    layer's) in place of the sharded DTensors, so a reshard or a state read right after ``logprobs``
    (the colocated hand-over after a recompute) would read plain full tensors. At one rank only
    with ``wrap_single_rank``: the engine trains the module unwrapped there otherwise."""
    engine = _engine(model, options=FSDPOptions(wrap_single_rank=True))
    batch = _batch(tok)
    shapes = {name: tuple(t.shape) for name, t in engine.local_shards().items()}
    engine.logprobs([s.prompt_ids for s in batch], [s.response_ids for s in batch])
    assert all(isinstance(p, DTensor) for p in engine.model.parameters())
    assert {name: tuple(t.shape) for name, t in engine.local_shards().items()} == shapes
    full = engine.full_state_dict()
    for name, expected in model.state_dict().items():
        torch.testing.assert_close(full[name], expected, atol=0, rtol=0)


def test_bad_samples_name_the_sample_and_field(model: torch.nn.Module, tok: PreTrainedTokenizerFast) -> None:
    engine = _engine(model)
    good = _batch(tok)
    bad = TrainSample(good[1].prompt_ids, good[1].response_ids, 0.0, rollout_logprobs=torch.zeros(5))
    with pytest.raises(TrainBatchError, match="sample 1: rollout_logprobs must be a 1-D float tensor with one value"):
        engine.accumulate([good[0], bad], LossConfig())
    with pytest.raises(TrainBatchError, match="sample 0: response_ids must be a 1-D int64"):
        engine.accumulate([TrainSample(good[0].prompt_ids, torch.zeros(3), 1.0)], LossConfig())
    with pytest.raises(TrainBatchError, match="sample 0: prompt_ids is empty"):
        engine.accumulate([TrainSample(torch.zeros(0, dtype=torch.int64), good[0].response_ids, 1.0)], LossConfig())
    with pytest.raises(TrainBatchError, match="sample 0: advantage is nan"):
        engine.accumulate([TrainSample(good[0].prompt_ids, good[0].response_ids, float("nan"))], LossConfig())
    with pytest.raises(TrainBatchError, match="ref_logprobs is given for some samples"):
        engine.accumulate([good[0], _batch(tok, with_ref=False)[1]], LossConfig())
    with pytest.raises(TrainBatchError, match="empty micro-batch"):
        engine.accumulate([], LossConfig())
    with pytest.raises(ValueError, match="ref_logprobs"):
        engine.accumulate(_batch(tok, with_ref=False), LossConfig(kl_coef=0.1))
    with pytest.raises(TrainBatchError, match="sample 2: prompt_ids must be a 1-D int64"):
        engine.logprobs([good[0].prompt_ids] * 2 + [good[0].prompt_ids.float()], [good[0].response_ids] * 3)


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
    assert samples[2].rollout_logprobs is batch[2].rollout_logprobs
    with pytest.raises(TrainBatchError, match="column 'advantage' is missing"):
        samples_from_columns({k: v for k, v in cols.items() if k != "advantage"})
    with pytest.raises(TrainBatchError, match="column 'advantage' has 1 values"):
        samples_from_columns({**cols, "advantage": [1.0]})
    # per-token advantages (a tensor, or a list as a plain decoder gives it) and a loss mask
    n = [s.response_ids.numel() for s in batch]
    per_token = samples_from_columns({**cols, "advantage": [[0.5] * k for k in n],
                                      "loss_mask": [torch.ones(k) for k in n]})
    assert all(torch.equal(s.token_advantages(), torch.full((k,), 0.5)) for s, k in zip(per_token, n, strict=True))
    assert [s.trained_tokens() for s in per_token] == n and per_token[0].loss_mask is not None


def test_zero_advantage_samples_are_counted_not_computed(model: torch.nn.Module, tok: PreTrainedTokenizerFast) -> None:
    """Without KL, a zero advantage has zero gradient: skipping it keeps the exact whole-batch gradient."""
    batch = [TrainSample(s.prompt_ids, s.response_ids, 0.0 if i in (0, 1, 4) else s.advantage, s.rollout_logprobs,
                         s.old_logprobs, None) for i, s in enumerate(_batch(tok))]
    for mode in MODES:
        cfg = LossConfig(loss_agg=mode)  # type: ignore[arg-type]
        expected = _reference_grads(model, batch, cfg)
        engine = _engine(model)
        grads = _captured_grads(engine)
        first = engine.accumulate(batch[:2], cfg)  # both zero: nothing to compute
        assert first["skipped_sequences"] == 2 and first["tokens"] == 5 and first["loss"] == 0.0
        engine.accumulate(batch[2:], cfg)
        assert engine.pending() == {"tokens": 19, "sequences": 6, "micro_batches": 2}
        stats = engine.step()
        assert stats["skipped_sequences"] == 3 and stats["tokens"] == 19 and stats["sequences"] == 6
        for name, g in expected.items():
            torch.testing.assert_close(grads[name], g, atol=1e-5, rtol=1e-4, msg=f"{mode} {name}")


def test_frozen_model_is_scored_by_the_logprob_engine_not_trained(
    model: torch.nn.Module, tok: PreTrainedTokenizerFast
) -> None:
    """The reference stage's case: a frozen policy only gives logprobs, the trainer's numbers."""
    batch = _batch(tok)
    prompts, responses = [s.prompt_ids for s in batch], [s.response_ids for s in batch]
    expected = _engine(model).logprobs(prompts, responses, temperature=0.7)
    frozen = copy.deepcopy(model).requires_grad_(False)
    for got, want in zip(LogprobEngine(frozen, device="cpu").logprobs(prompts, responses, 0.7), expected,
                         strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="no trainable parameters"):
        FSDPTrainEngine(frozen, lr=1.0, device="cpu")
