"""GAE and PPO's clipped value loss against independent references written from the formulas.

GAE (Schulman et al. 2016) is checked against a plain Python loop over one response at a time:
the sequence reward on the last token, delta_t = r_t + gamma V_{t+1} - V_t with V_T = 0, and
A_t = delta_t + gamma lam A_{t+1}; the estimator computes all responses at once on padded rows.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from streamrl.algos.advantages import ADVANTAGES, gae, takes_values
from streamrl.algos.losses import clipped_value_loss


def reference_gae(reward: float, values: list[float], gamma: float, lam: float) -> tuple[list[float], list[float]]:
    """One response: (advantages, returns) by the backward recursion, in float64 Python numbers."""
    T = len(values)
    advantages = [0.0] * T
    running = 0.0
    for t in reversed(range(T)):
        r = reward if t == T - 1 else 0.0
        next_value = values[t + 1] if t + 1 < T else 0.0
        delta = r + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        advantages[t] = running
    return advantages, [a + v for a, v in zip(advantages, values, strict=True)]


def _case(seed: int) -> tuple[Tensor, list[Tensor]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 4, 2, 7, 3]  # ragged: a one-token response and the longest pad the others
    rewards = torch.rand(len(lengths), generator=g) * 2 - 0.5
    values = [torch.randn(n, generator=g) for n in lengths]
    return rewards, values


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (0.9, 0.8), (0.99, 0.0), (1.0, 1.0)])
def test_gae_matches_the_recursion(gamma: float, lam: float) -> None:
    rewards, values = _case(0)
    advantages, returns = gae(rewards, torch.zeros(len(values), dtype=torch.long), values, gamma=gamma, lam=lam)
    for i, v in enumerate(values):
        ref_adv, ref_ret = reference_gae(float(rewards[i]), v.tolist(), gamma, lam)
        torch.testing.assert_close(advantages[i], torch.tensor(ref_adv, dtype=torch.float32), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(returns[i], torch.tensor(ref_ret, dtype=torch.float32), atol=1e-6, rtol=1e-6)
        assert advantages[i].dtype == torch.float32 and advantages[i].shape == v.shape


def test_gamma_and_lambda_one_is_reward_minus_value() -> None:
    rewards, values = _case(1)
    advantages, returns = gae(rewards, torch.arange(len(values)), values, gamma=1.0, lam=1.0)
    for i, v in enumerate(values):
        torch.testing.assert_close(advantages[i], float(rewards[i]) - v, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(returns[i], torch.full_like(v, float(rewards[i])), atol=1e-6, rtol=1e-6)


def test_whiten_scales_the_advantages_only() -> None:
    rewards, values = _case(2)
    groups = torch.zeros(len(values), dtype=torch.long)
    plain, returns = gae(rewards, groups, values)
    white, white_returns = gae(rewards, groups, values, whiten=True)
    flat = torch.cat(plain)
    expected = (flat - flat.mean()) / (flat.std(correction=0) + 1e-8)
    torch.testing.assert_close(torch.cat(white), expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(torch.cat(white_returns), torch.cat(returns))  # the critic's targets unchanged


def test_gae_is_registered_and_needs_values() -> None:
    assert ADVANTAGES.resolve("gae") is gae and takes_values(gae)
    assert not takes_values(ADVANTAGES.resolve("grpo"))
    with pytest.raises(ValueError, match="2 value tensors for 3 rewards"):
        gae(torch.zeros(3), torch.zeros(3, dtype=torch.long), [torch.zeros(1), torch.zeros(2)])
    with pytest.raises(ValueError, match="non-finite"):
        gae(torch.zeros(1), torch.zeros(1, dtype=torch.long), [torch.tensor([float("nan")])])


def test_clipped_value_loss_reference() -> None:
    values = torch.tensor([0.5, 0.1, -0.4, 2.0, 0.0])
    old = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.3])
    returns = torch.tensor([1.0, -1.0, 0.5, 1.0, 0.3])
    c = 0.2
    expected, expected_clipped = [], []
    for v, o, r in zip(values.tolist(), old.tolist(), returns.tolist(), strict=True):
        v_clip = min(max(v, o - c), o + c)
        unclipped, clipped = (v - r) ** 2, (v_clip - r) ** 2
        expected.append(max(unclipped, clipped))
        expected_clipped.append(clipped > unclipped)
    loss, clipped = clipped_value_loss(values, old, returns, c)
    torch.testing.assert_close(loss, torch.tensor(expected), atol=1e-6, rtol=1e-6)
    assert clipped.tolist() == expected_clipped
    # hand values: token 0 (V 0.5, old 0, R 1): clip -> 0.2, (0.2 - 1)^2 = 0.64 > 0.25
    assert loss[0].item() == pytest.approx(0.64, abs=1e-6) and clipped[0]
    plain, none = clipped_value_loss(values, old, returns, None)
    torch.testing.assert_close(plain, (values - returns) ** 2)
    assert not none.any()


def test_clipped_value_loss_gradient_stops_at_the_clip() -> None:
    # V moved past the clip in the wrong direction: the clipped term is the larger, constant in V
    values = torch.tensor([0.5], requires_grad=True)
    loss, clipped = clipped_value_loss(values, torch.tensor([0.0]), torch.tensor([1.0]), 0.2)
    loss.sum().backward()
    assert clipped.item() and values.grad is not None and values.grad.item() == 0.0
