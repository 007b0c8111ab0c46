"""Policy losses and off-policy corrections (streamrl.algos.losses) against hand-computed values."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from streamrl.algos.losses import (
    CORRECTIONS,
    POLICY_LOSSES,
    cispo,
    gspo,
    masked_is,
    ppo_clip,
    truncated_is,
)
from streamrl.algos.registry import UnknownAlgorithmError


@dataclass(frozen=True)
class ClipConfig:
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None


# The pre-registry implementations of streamrl.algos.grpo, verbatim (grpo.py now calls the registries):
# the built-ins must reproduce them exactly.
def clipped_policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, *, clip_low: float,
                        clip_high: float) -> tuple[Tensor, Tensor]:
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    return loss, (clipped > unclipped).detach()


def truncated_is_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, cap: float) -> Tensor:
    return torch.exp(old_logprobs - rollout_logprobs).clamp(max=cap).detach()


def _f64(*values: float) -> Tensor:
    return torch.tensor(values, dtype=torch.float64)


# ------------------------------------------------------------------------------------------------
# ppo_clip
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("clip_low", "clip_high"), [(0.2, 0.2), (0.2, 0.28)])
def test_ppo_clip_equals_grpo_clipped_policy_loss(clip_low: float, clip_high: float) -> None:
    gen = torch.Generator().manual_seed(0)
    n = 257
    logprobs = (-torch.rand(n, generator=gen) * 3).requires_grad_(True)
    old = logprobs.detach() + torch.randn(n, generator=gen) * 0.3  # ratios spread over the clip edges
    adv = torch.randn(n, generator=gen)
    seq_index = torch.arange(n) // 10
    loss, clipped = ppo_clip(logprobs, old, adv, seq_index, ClipConfig(clip_low, clip_high))
    ref_loss, ref_clipped = clipped_policy_loss(logprobs, old, adv, clip_low=clip_low, clip_high=clip_high)
    assert torch.equal(loss, ref_loss)
    assert torch.equal(clipped, ref_clipped)
    assert 0 < int(clipped.sum()) < n  # both branches exercised
    (grad,) = torch.autograd.grad(loss.sum(), logprobs)
    (ref_grad,) = torch.autograd.grad(ref_loss.sum(), logprobs)
    assert torch.equal(grad, ref_grad)


def test_ppo_clip_hand_computed_and_dual_clip() -> None:
    # ratios r = exp(logp - old) with old = 0
    r = _f64(5.0, 2.0, 5.0, 0.5, 10.0)
    adv = _f64(-1.0, -1.0, 1.0, -1.0, 2.0)
    logprobs = torch.log(r).requires_grad_(True)
    old = torch.zeros(5, dtype=torch.float64)
    seq_index = torch.tensor([0, 0, 1, 1, 2])
    # Plain PPO-clip (0.8..1.2):
    #   A=-1, r=5:  max(5, 1.2) = 5        unclipped
    #   A=-1, r=2:  max(2, 1.2) = 2        unclipped
    #   A=+1, r=5:  max(-5, -1.2) = -1.2   clipped
    #   A=-1, r=.5: max(0.5, 0.8) = 0.8    clipped
    #   A=+2, r=10: max(-20, -2.4) = -2.4  clipped
    loss, clipped = ppo_clip(logprobs, old, adv, seq_index, ClipConfig())
    torch.testing.assert_close(loss, _f64(5.0, 2.0, -1.2, 0.8, -2.4))
    assert clipped.tolist() == [False, False, True, True, True]
    # Dual clip c = 3: tokens with A < 0 are capped at 3·|A| = 3:
    #   A=-1, r=5: min(5, 3) = 3 (capped -> clipped); A=-1, r=2: min(2, 3) = 2; A=-1, r=.5: 0.8.
    #   A > 0 tokens are untouched.
    loss, clipped = ppo_clip(logprobs, old, adv, seq_index, ClipConfig(dual_clip=3.0))
    torch.testing.assert_close(loss, _f64(3.0, 2.0, -1.2, 0.8, -2.4))
    assert clipped.tolist() == [True, False, True, True, True]
    (grad,) = torch.autograd.grad(loss.sum(), logprobs)
    # d(-A·r)/dlogp = -A·r on the unclipped token 1 (A=-1, r=2): 2; every clipped/capped token: 0
    torch.testing.assert_close(grad, _f64(0.0, 2.0, 0.0, 0.0, 0.0))
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        ppo_clip(logprobs, old, adv, seq_index, ClipConfig(dual_clip=1.0))


def test_shape_errors_name_the_shapes() -> None:
    a3, a4 = torch.zeros(3), torch.zeros(4)
    idx = torch.zeros(3, dtype=torch.long)
    for fn in (ppo_clip, gspo, cispo):
        with pytest.raises(ValueError, match=r"old_logprobs \(4,\)"):
            fn(a3, a4, a3, idx, ClipConfig())
        with pytest.raises(ValueError, match=r"logprobs \(1, 3\)"):
            fn(a3[None], a3[None], a3[None], idx[None], ClipConfig())
    with pytest.raises(ValueError, match="integer"):
        gspo(a3, a3, a3, idx.float(), ClipConfig())
    for corr in (truncated_is, masked_is):
        with pytest.raises(ValueError, match=r"rollout_logprobs \(4,\)"):
            corr(a3, a4, 2.0)
        with pytest.raises(ValueError, match="cap must be > 0"):
            corr(a3, a3, 0.0)


# ------------------------------------------------------------------------------------------------
# gspo
# ------------------------------------------------------------------------------------------------


def test_gspo_hand_computed_two_sequences() -> None:
    # Interleaved tokens: seq 0 = tokens 0, 2, 4; seq 1 = tokens 1, 3.
    seq_index = torch.tensor([0, 1, 0, 1, 0])
    old = _f64(-1.0, -2.0, -0.5, -1.0, -3.0)
    delta = _f64(0.1, 0.5, -0.1, 0.3, 0.3)  # logp - old
    logprobs = old + delta
    adv = _f64(1.0, 2.0, 1.0, 2.0, 1.0)
    # seq 0: mean(0.1, -0.1, 0.3) = 0.1 -> s0 = exp(0.1) = 1.105170918 in [0.8, 1.2]:
    #        loss = max(-1·1.10517, -1·1.10517) = -1.10517, not clipped
    # seq 1: mean(0.5, 0.3) = 0.4 -> s1 = exp(0.4) = 1.491824698 > 1.2, A = 2:
    #        loss = max(-2·1.49182, -2·1.2) = -2.4, clipped
    s0 = math.exp(0.1)
    loss, clipped = gspo(logprobs, old, adv, seq_index, ClipConfig())
    torch.testing.assert_close(loss, _f64(-s0, -2.4, -s0, -2.4, -s0))
    assert clipped.tolist() == [False, True, False, True, False]
    # The paper's tiny clip range (3e-4 / 4e-4): s0 = exp(0.1) is far out of [0.9997, 1.0004]:
    #   seq 0: max(-1.10517, -1.0004) = -1.0004; seq 1: max(-2.98365, -2·1.0004) = -2.0008
    loss, clipped = gspo(logprobs, old, adv, seq_index, ClipConfig(3e-4, 4e-4))
    torch.testing.assert_close(loss, _f64(-1.0004, -2.0008, -1.0004, -2.0008, -1.0004))
    assert clipped.all()
    # ... and a sequence with mean log-ratio 2e-4 (s = exp(2e-4) = 1.00020002) stays inside it:
    #   A = -1: max(1.0002, 1.0002) = 1.00020002, not clipped
    loss, clipped = gspo(_f64(1e-4, 3e-4), _f64(0.0, 0.0), _f64(-1.0, -1.0), torch.tensor([0, 0]),
                         ClipConfig(3e-4, 4e-4))
    torch.testing.assert_close(loss, _f64(math.exp(2e-4), math.exp(2e-4)))
    assert not clipped.any()


def test_gspo_gradient_equals_sequence_level_objective() -> None:
    gen = torch.Generator().manual_seed(1)
    lengths = [3, 5, 1, 4]
    seq_index = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths))
    n = seq_index.numel()
    old = -torch.rand(n, generator=gen, dtype=torch.float64) * 2
    delta = (torch.rand(n, generator=gen, dtype=torch.float64) - 0.5) * 0.1  # |mean| < 0.05: inside 0.8..1.2
    delta[seq_index == 3] += 0.5  # sequence 3 far above 1.2 (and A > 0): clipped, no gradient
    logprobs = (old + delta).requires_grad_(True)
    seq_adv = torch.tensor([1.5, -0.7, 0.4, 2.0], dtype=torch.float64)
    adv = seq_adv[seq_index]
    config = ClipConfig()

    # Token-level form, aggregated as seq-mean-token-mean (× S): Σ_i (1/|y_i|) Σ_t loss_t
    loss, clipped = gspo(logprobs, old, adv, seq_index, config)
    length_per_token = torch.tensor(lengths, dtype=torch.float64)[seq_index]
    (token_grad,) = torch.autograd.grad((loss / length_per_token).sum(), logprobs)

    # Sequence-level objective: Σ_i max(-A_i·s_i, -A_i·clip(s_i)), s_i = exp(mean(logp - old))
    seq_loss = []
    for i in range(4):
        s = torch.exp((logprobs[seq_index == i] - old[seq_index == i]).mean())
        a = seq_adv[i]
        seq_loss.append(torch.maximum(-a * s, -a * torch.clamp(s, 0.8, 1.2)))
    seq_losses = torch.stack(seq_loss)
    (seq_grad,) = torch.autograd.grad(seq_losses.sum(), logprobs)

    torch.testing.assert_close(token_grad, seq_grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(loss, seq_losses.detach()[seq_index])  # every token carries its sequence's value
    assert clipped.tolist() == (seq_index == 3).tolist()
    assert torch.all(token_grad[seq_index == 3] == 0)
    assert torch.all(token_grad[seq_index != 3] != 0)
    # Within a sequence every token gets the same gradient: -A_i·s_i/|y_i|
    s1 = math.exp(float(delta[seq_index == 1].mean()))
    torch.testing.assert_close(token_grad[seq_index == 1], torch.full((5,), 0.7 * s1 / 5, dtype=torch.float64))


def test_gspo_empty_batch_and_float32() -> None:
    empty = torch.zeros(0)
    loss, clipped = gspo(empty, empty, empty, torch.zeros(0, dtype=torch.long), ClipConfig())
    assert loss.shape == (0,) and clipped.shape == (0,)
    # float32 inputs keep a float32 loss
    loss, _ = gspo(torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -2.0]), torch.tensor([1.0, 1.0]),
                   torch.tensor([0, 0]), ClipConfig())
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, torch.tensor([-1.0, -1.0]))  # s = exp(0) = 1, A = 1


# ------------------------------------------------------------------------------------------------
# cispo
# ------------------------------------------------------------------------------------------------


def test_cispo_value_and_gradient() -> None:
    logprobs = _f64(-1.0, -0.5, -2.0, -0.3).requires_grad_(True)
    old = _f64(-1.0, -1.0, -1.0, -0.4)
    adv = _f64(1.0, 2.0, -1.0, -3.0)
    seq_index = torch.tensor([0, 0, 1, 1])
    # r = exp(logp - old) = [exp(0) = 1, exp(0.5) = 1.6487, exp(-1) = 0.3679, exp(0.1) = 1.10517]
    # w = clip(r, 0.8, 1.2)      = [1, 1.2, 0.8, 1.10517]
    # loss = -w·A·logp: 1:  -1·1·(-1)         = 1
    #                   2:  -1.2·2·(-0.5)     = 1.2
    #                   3:  -0.8·(-1)·(-2)    = -1.6
    #                   4:  -1.10517·(-3)·(-0.3) = -0.994654
    w4 = math.exp(0.1)
    loss, clipped = cispo(logprobs, old, adv, seq_index, ClipConfig())
    torch.testing.assert_close(loss, _f64(1.0, 1.2, -1.6, -w4 * 0.9))
    assert clipped.tolist() == [False, True, True, False]
    (grad,) = torch.autograd.grad(loss.sum(), logprobs)
    # grad = -w·A = [-1, -2.4, 0.8, 3.31551], every token (clipped ones too), none through w
    weight = torch.clamp(torch.exp(logprobs.detach() - old), 0.8, 1.2)
    assert torch.equal(grad, -weight * adv)
    torch.testing.assert_close(grad, _f64(-1.0, -2.4, 0.8, 3 * w4))


# ------------------------------------------------------------------------------------------------
# corrections
# ------------------------------------------------------------------------------------------------


def test_tis_and_mis_values() -> None:
    rollout = _f64(-1.0, -2.0, -3.0, -0.5, -1.0)
    # old - rollout = [0, log 1.5, log 3, -log 2, log 2]: ratio = [1, 1.5, 3, 0.5, 2]
    old = (rollout + torch.log(_f64(1.0, 1.5, 3.0, 0.5, 2.0))).requires_grad_(True)
    # cap 2: tis = min(ratio, 2) = [1, 1.5, 2, 0.5, 2]; mis = ratio if <= 2 else 0 = [1, 1.5, 0, 0.5, 2]
    tis = truncated_is(old, rollout, 2.0)
    mis = masked_is(old, rollout, 2.0)
    torch.testing.assert_close(tis, _f64(1.0, 1.5, 2.0, 0.5, 2.0))
    torch.testing.assert_close(mis, _f64(1.0, 1.5, 0.0, 0.5, 2.0))  # exp(log 2) rounds to exactly 2.0 <= 2
    assert not tis.requires_grad and not mis.requires_grad
    assert torch.equal(tis, truncated_is_weights(old, rollout, 2.0))
    # a ratio of exactly the cap is kept by mis (<=): ratio exp(0) = 1, cap 1
    assert masked_is(_f64(0.0), _f64(0.0), 1.0).tolist() == [1.0]


# ------------------------------------------------------------------------------------------------
# registries
# ------------------------------------------------------------------------------------------------


def user_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, seq_index: Tensor,
              config: ClipConfig, scale: float = 2.0) -> tuple[Tensor, Tensor]:
    """A user's policy loss (an extra parameter with a default is fine)."""
    return -scale * advantages * logprobs, torch.zeros_like(logprobs, dtype=torch.bool)


def lacks_config(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
                 seq_index: Tensor) -> tuple[Tensor, Tensor]:
    return logprobs, logprobs > 0


def wants_more(old_logprobs: Tensor, rollout_logprobs: Tensor, cap: float, temperature: float) -> Tensor:
    return old_logprobs


def test_registries() -> None:
    assert POLICY_LOSSES.names() == ["cispo", "gspo", "ppo_clip"]
    assert CORRECTIONS.names() == ["mis", "tis"]
    assert POLICY_LOSSES.resolve("gspo") is gspo
    assert CORRECTIONS.resolve("tis") is truncated_is
    assert CORRECTIONS.resolve("mis") is masked_is
    with pytest.raises(UnknownAlgorithmError, match="did you mean 'gspo'"):
        POLICY_LOSSES.resolve("gpso")
    fn = POLICY_LOSSES.resolve(f"{__name__}:user_loss")
    assert fn is user_loss
    loss, _ = fn(logprobs=_f64(-1.0), old_logprobs=_f64(-1.0), advantages=_f64(3.0),
                 seq_index=torch.tensor([0]), config=ClipConfig())
    assert loss.tolist() == [6.0]  # -2·3·(-1)
    with pytest.raises(UnknownAlgorithmError, match="lacks the parameter"):
        POLICY_LOSSES.resolve(f"{__name__}:lacks_config")
    with pytest.raises(UnknownAlgorithmError, match="temperature"):
        CORRECTIONS.resolve(f"{__name__}:wants_more")
    with pytest.raises(UnknownAlgorithmError, match="lacks the parameter"):
        POLICY_LOSSES.register("broken")(lacks_config)
    assert "broken" not in POLICY_LOSSES
    # every built-in is called by keyword, as the trainer calls it
    x = _f64(-1.0, -2.0)
    for name in POLICY_LOSSES:
        loss, clipped = POLICY_LOSSES.resolve(name)(logprobs=x, old_logprobs=x, advantages=_f64(1.0, -1.0),
                                                     seq_index=torch.tensor([0, 1]), config=ClipConfig())
        assert loss.shape == clipped.shape == (2,) and clipped.dtype == torch.bool


@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "cispo"])
def test_zero_advantage_gives_zero_loss_and_gradient(name: str) -> None:
    # grpo.ZERO_AT_ZERO_ADVANTAGE lets the trainer skip samples with A = 0 for the built-ins
    logprobs = _f64(-1.0, -0.2, -3.0).requires_grad_(True)
    old = _f64(-2.0, -0.2, -1.0)  # ratios e, 1, e^-2: inside and outside the clip range
    fn = POLICY_LOSSES.resolve(name)
    loss, _ = fn(logprobs=logprobs, old_logprobs=old, advantages=torch.zeros(3, dtype=torch.float64),
                 seq_index=torch.tensor([0, 0, 1]), config=ClipConfig(dual_clip=3.0))
    (grad,) = torch.autograd.grad(loss.sum(), logprobs)
    assert torch.all(loss == 0) and torch.all(grad == 0)


def test_a_users_policy_loss_named_as_module_function_is_what_the_trainer_computes() -> None:
    from streamrl.algos.grpo import LossConfig, per_token_loss

    config = LossConfig(policy_loss="tests.algos.user_algos:reinforce")
    logp = torch.tensor([-0.5, -1.0, -2.0], requires_grad=True)
    adv = torch.tensor([1.0, 1.0, -2.0])
    loss, stats = per_token_loss(logp, adv, config, old_logprobs=logp.detach() - 0.3)
    torch.testing.assert_close(loss, -adv * logp)
    assert stats["clipped"].sum() == 0
    with pytest.raises(ValueError, match=r"policy_loss: .*reinforce_x.* has no function"):
        LossConfig(policy_loss="tests.algos.user_algos:reinforce_x")
