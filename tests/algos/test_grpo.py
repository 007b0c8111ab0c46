"""GRPO maths against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from streamrl.algos.grpo import (
    LossConfig,
    aggregate_loss,
    group_advantages,
    loss_denominator,
    per_token_loss,
    unnormalized_loss,
)
from streamrl.algos.kl import kl_penalty
from streamrl.algos.losses import ppo_clip, truncated_is


def clipped_policy_loss(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, *, clip_low: float,
                        clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The ppo_clip policy loss with only the clip range set."""
    cfg = LossConfig(clip_low=clip_low, clip_high=clip_high)
    return ppo_clip(logprobs=logp, old_logprobs=old, advantages=adv, seq_index=torch.zeros_like(adv, dtype=torch.long),
                    config=cfg)


def test_group_advantages_hand_computed() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.3])
    groups = torch.tensor([7, 7, 7, 7, 2, 2, 2, 2, 9])  # any ids; group 9 has one sample
    adv = group_advantages(rewards, groups)
    # group 7: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    torch.testing.assert_close(adv, torch.tensor([a, -a, -a, a, 0, 0, 0, 0, 0]))
    centred = group_advantages(rewards, groups, normalize_std=False)
    torch.testing.assert_close(centred, torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0, 0]))
    interleaved = group_advantages(torch.tensor([1.0, 3.0, 2.0, 5.0]), torch.tensor([0, 1, 0, 1]), eps=0.0)
    # group 0: [1, 2] -> centred -/+0.5, std sqrt(0.5); group 1: [3, 5] -> -/+1, std sqrt(2)
    h = math.sqrt(0.5)
    torch.testing.assert_close(interleaved, torch.tensor([-h, -h, h, h]))
    # Equal rewards: exactly 0, even where the float mean misses the common value by an ulp.
    for value in (0.3, 0.1, 1 / 3, 0.7):
        same = group_advantages(torch.full((8,), value), torch.zeros(8, dtype=torch.long))
        assert torch.equal(same, torch.zeros(8))
    with pytest.raises(ValueError, match="equal 1-D"):
        group_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.long))


def test_clipped_policy_loss_hand_computed() -> None:
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 1.5, 0.5, 0.5])).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, clipped = clipped_policy_loss(logp, old, adv, clip_low=0.2, clip_high=0.2)
    # r=1.5, A=+1: max(-1.5, -1.2) = -1.2 (clipped); A=-1: max(1.5, 1.2) = 1.5
    # r=0.5, A=+1: max(-0.5, -0.8) = -0.5; A=-1: max(0.5, 0.8) = 0.8 (clipped)
    torch.testing.assert_close(loss, torch.tensor([-1.2, 1.5, -0.5, 0.8]))
    assert clipped.tolist() == [True, False, False, True]
    loss.sum().backward()
    # d(-A r)/dlogp = -A r where not clipped; 0 where clipped.
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, 1.5, -0.5, 0.0]))


def test_clip_high_is_separate_from_clip_low() -> None:
    logp = torch.log(torch.tensor([1.25, 0.75]))
    loss, clipped = clipped_policy_loss(logp, torch.zeros(2), torch.ones(2), clip_low=0.2, clip_high=0.28)
    torch.testing.assert_close(loss, torch.tensor([-1.25, -0.75]))
    assert clipped.tolist() == [False, False]
    loss, clipped = clipped_policy_loss(logp, torch.zeros(2), -torch.ones(2), clip_low=0.2, clip_high=0.28)
    torch.testing.assert_close(loss, torch.tensor([1.25, 0.8]))
    assert clipped.tolist() == [False, True]


def test_truncated_importance_weights() -> None:
    old = torch.zeros(3)
    rollout = torch.log(torch.tensor([0.25, 1.0, 2.0]))
    torch.testing.assert_close(truncated_is(old, rollout, cap=2.0), torch.tensor([2.0, 1.0, 0.5]))


def test_kl_estimators_hand_computed() -> None:
    logp = torch.log(torch.tensor([0.5]))
    ref = torch.log(torch.tensor([0.25]))
    log2 = math.log(2.0)
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([log2]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), torch.tensor([0.5 * log2 * log2]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), torch.tensor([0.5 + log2 - 1.0]))
    with pytest.raises(ValueError, match=r"unknown KL estimator 'k4'.*registered: k1, k2, k3"):
        kl_penalty(logp, ref, "k4")
    # a user's estimator by module:function, and the gradient flows through logprobs only
    logp = logp.clone().requires_grad_()
    ref = ref.clone().requires_grad_()
    user = kl_penalty(logp, ref, "tests.algos.user_algos:squared_log_ratio")
    torch.testing.assert_close(user, torch.tensor([log2 * log2]))
    user.sum().backward()
    assert logp.grad is not None and ref.grad is None
    with pytest.raises(ValueError, match=r"LossConfig.kl_estimator.*did you mean 'k3'"):
        LossConfig(kl_estimator="k33")


def test_per_token_loss_combines_tis_and_kl() -> None:
    logp = torch.log(torch.tensor([0.5, 0.5]))
    old = torch.log(torch.tensor([0.5, 0.4]))
    rollout = torch.log(torch.tensor([0.25, 0.5]))
    ref = torch.log(torch.tensor([0.25, 0.5]))
    adv = torch.tensor([1.0, 1.0])
    cfg = LossConfig(kl_coef=0.1, kl_estimator="k1", is_cap=1.5)
    loss, stats = per_token_loss(logp, adv, cfg, old_logprobs=old, rollout_logprobs=rollout, ref_logprobs=ref)
    # token 0: ratio 1, is-weight min(2, 1.5) = 1.5, pg = -1.5; kl k1 = log 2
    # token 1: ratio 1.25 -> clipped 1.2, is-weight 0.8, pg = -0.96; kl 0
    torch.testing.assert_close(loss, torch.tensor([-1.5 + 0.1 * math.log(2.0), -0.96]))
    torch.testing.assert_close(stats["is_weight"], torch.tensor([1.5, 0.8]))
    assert stats["clipped"].tolist() == [0.0, 1.0]
    # Without old logprobs the rollout ones are the behaviour policy and no IS weight applies.
    loss, stats = per_token_loss(logp, adv, LossConfig(), rollout_logprobs=rollout)
    torch.testing.assert_close(loss, torch.tensor([-1.2, -1.0]))
    assert "is_weight" not in stats
    # With nothing, the ratio is 1 (single on-policy update): loss = -A.
    loss, _ = per_token_loss(logp, adv, LossConfig())
    torch.testing.assert_close(loss, -adv)
    with pytest.raises(ValueError, match="ref_logprobs"):
        per_token_loss(logp, adv, LossConfig(kl_coef=0.1))


def test_aggregations_hand_computed() -> None:
    per_token = torch.tensor([1.0, 2.0, 3.0, 4.0])
    seq_index = torch.tensor([0, 0, 0, 2])  # sequence 1 is empty
    assert float(aggregate_loss(per_token, seq_index, 3, "token-mean")) == pytest.approx(10 / 4)
    assert float(aggregate_loss(per_token, seq_index, 3, "seq-mean-token-mean")) == pytest.approx((2 + 0 + 4) / 3)
    assert float(aggregate_loss(per_token, seq_index, 3, "seq-mean-token-sum")) == pytest.approx((6 + 0 + 4) / 3)
    assert loss_denominator("token-mean", 4, 3) == 4
    assert loss_denominator("seq-mean-token-sum", 4, 3) == 3
    with pytest.raises(ValueError, match="unknown loss aggregation 'token-median'"):
        unnormalized_loss(per_token, seq_index, 3, "token-median")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_streamed_sums_equal_the_whole_batch(mode: str) -> None:
    g = torch.Generator().manual_seed(0)
    lengths = [3, 1, 4, 2, 5]
    per_token = torch.randn(sum(lengths), generator=g)
    seq_index = torch.repeat_interleave(torch.arange(5), torch.tensor(lengths))
    whole = aggregate_loss(per_token, seq_index, 5, mode)  # type: ignore[arg-type]
    for split in ([2, 3], [1, 1, 1, 1, 1], [5]):
        total, start_seq, start_tok = 0.0, 0, 0
        for n in split:
            n_tok = sum(lengths[start_seq : start_seq + n])
            chunk = per_token[start_tok : start_tok + n_tok]
            idx = seq_index[start_tok : start_tok + n_tok] - start_seq
            total += float(unnormalized_loss(chunk, idx, n, mode))  # type: ignore[arg-type]
            start_seq, start_tok = start_seq + n, start_tok + n_tok
        denominator = loss_denominator(mode, len(per_token), 5)  # type: ignore[arg-type]
        assert total / denominator == pytest.approx(float(whole), rel=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"clip_low": 1.5}, "clip_low"),
        ({"dual_clip": 1.0}, "dual_clip"),
        ({"norm_tokens": 0}, "norm_tokens"),
        ({"policy_loss": "gpso"}, "did you mean 'gspo'"),
        ({"correction": "tls"}, "did you mean 'tis'"),
        ({"policy_loss": "streamrl.algos.kl:kl_penalty"}, "lacks the parameter"),
        ({"clip_high": -0.1}, "clip_high"),
        ({"kl_coef": -1.0}, "kl_coef"),
        ({"is_cap": 0.0}, "is_cap"),
        ({"temperature": 0.0}, "temperature"),
    ],
)
def test_loss_config_validation(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        LossConfig(**kwargs)


def test_loss_config_defaults() -> None:
    cfg = LossConfig()
    assert (cfg.clip_low, cfg.clip_high, cfg.kl_coef, cfg.kl_estimator) == (0.2, 0.2, 0.0, "k3")
    assert (cfg.loss_agg, cfg.is_cap, cfg.temperature) == ("token-mean", 2.0, 1.0)


def test_kl_in_the_reward_hand_computed() -> None:
    from streamrl.algos.grpo import kl_reward_penalty, zero_at_zero_advantage

    rollout = torch.log(torch.tensor([0.5, 0.25]))
    ref = torch.log(torch.tensor([0.25, 0.25]))
    # k1 per token: logp - ref = ln 2, 0 -> summed ln 2, times 0.5
    assert kl_reward_penalty(rollout, ref, 0.5, "k1") == pytest.approx(0.5 * math.log(2))
    # in the reward, the trainer adds no KL: zero advantages stay free, and no ref logprobs are needed
    cfg = LossConfig(kl_coef=0.5, kl_in="reward")
    assert zero_at_zero_advantage(cfg) and not zero_at_zero_advantage(LossConfig(kl_coef=0.5))
    logp = torch.log(torch.tensor([0.5, 0.5]))
    loss, stats = per_token_loss(logp, torch.zeros(2), cfg)
    assert torch.equal(loss, torch.zeros(2)) and "kl" not in stats
