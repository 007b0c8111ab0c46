"""Advantage estimators against hand-computed values, their registry, and random-input properties."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from streamrl.algos.advantages import ADVANTAGES, dr_grpo, grpo, reinforce_pp, rloo
from streamrl.algos.registry import UnknownAlgorithmError

BUILT_INS = ("dr_grpo", "grpo", "reinforce_pp", "rloo")


def my_estimator(rewards: Tensor, group_ids: Tensor, scale: float = 2.0) -> Tensor:
    """A user estimator, named as tests.algos.test_advantages:my_estimator."""
    return rewards.to(torch.float32) * scale


def no_group_ids(rewards: Tensor) -> Tensor:
    """Lacks group_ids: the registry must refuse it."""
    return rewards


# One interleaved batch, used by every hand-computed test:
#   index:  0    1    2    3    4    5    6    7
#   reward: 1    2    3    6    0.5  0.5  1    4
#   group:  4    8    4    8    3    3    8    1
# group 4 (idx 0, 2): [1, 3], mean 2, centred [-1, +1], unbiased std sqrt((1 + 1) / 1) = sqrt(2)
# group 8 (idx 1, 3, 6): [2, 6, 1], mean 3, centred [-1, +3, -2], unbiased std sqrt((1 + 9 + 4) / 2) = sqrt(7)
# group 3 (idx 4, 5): equal rewards -> 0; group 1 (idx 7): one sample -> 0
REWARDS = torch.tensor([1.0, 2.0, 3.0, 6.0, 0.5, 0.5, 1.0, 4.0])
GROUPS = torch.tensor([4, 8, 4, 8, 3, 3, 8, 1])
CENTRED = [-1.0, -1.0, 1.0, 3.0, 0.0, 0.0, -2.0, 0.0]


def test_grpo_hand_computed() -> None:
    s2, s7 = math.sqrt(2) + 1e-6, math.sqrt(7) + 1e-6
    expected = torch.tensor([-1 / s2, -1 / s7, 1 / s2, 3 / s7, 0, 0, -2 / s7, 0])
    torch.testing.assert_close(grpo(REWARDS, GROUPS), expected)
    # eps is an option: eps=0.5 -> group 4: 1 / (sqrt(2) + 0.5)
    assert grpo(REWARDS, GROUPS, eps=0.5)[2].item() == pytest.approx(1 / (math.sqrt(2) + 0.5), rel=1e-6)


def test_dr_grpo_hand_computed() -> None:
    # reward minus group mean, nothing else
    torch.testing.assert_close(dr_grpo(REWARDS, GROUPS), torch.tensor(CENTRED))


def test_rloo_hand_computed() -> None:
    # group 4 (G=2): 1 - 3 = -2, 3 - 1 = +2
    # group 8 (G=3): 2 - (6+1)/2 = -1.5, 6 - (2+1)/2 = 4.5, 1 - (2+6)/2 = -3
    #   = 3/2 * centred [-1, 3, -2]
    # group 3: 0.5 - 0.5 = 0; group 1 (G=1): no other sample -> 0
    expected = torch.tensor([-2.0, -1.5, 2.0, 4.5, 0.0, 0.0, -3.0, 0.0])
    torch.testing.assert_close(rloo(REWARDS, GROUPS), expected)


def test_reinforce_pp_hand_computed() -> None:
    # centred c = [-1, -1, 1, 3, 0, 0, -2, 0]: batch mean 0, sum of squares 1+1+1+9+4 = 16,
    # population std over the N=8 values sqrt(16 / 8) = sqrt(2); a = c / (sqrt(2) + eps), mean 0 already
    s2 = math.sqrt(2) + 1e-6
    torch.testing.assert_close(reinforce_pp(REWARDS, GROUPS), torch.tensor(CENTRED) / s2)
    # eps=0: c / sqrt(2), so group 8's best sample gets 3 / sqrt(2)
    assert reinforce_pp(REWARDS, GROUPS, eps=0.0)[3].item() == pytest.approx(3 / math.sqrt(2), rel=1e-6)


def test_reinforce_pp_recentres_over_the_batch() -> None:
    # one group: [0, 0, 0, 4] mean 1 -> c = [-1, -1, -1, 3]; population std sqrt((1+1+1+9) / 4) = sqrt(3)
    # c / sqrt(3) has batch mean 0 already, so re-centring changes nothing
    adv = reinforce_pp(torch.tensor([0.0, 0.0, 0.0, 4.0]), torch.zeros(4, dtype=torch.long), eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([-1.0, -1.0, -1.0, 3.0]) / math.sqrt(3))
    assert abs(adv.sum().item()) < 1e-6


@pytest.mark.parametrize("name", BUILT_INS)
def test_group_of_one_and_equal_rewards_are_exactly_zero(name: str) -> None:
    estimator = ADVANTAGES.resolve(name)
    single = estimator(torch.tensor([0.7]), torch.tensor([3]))
    assert torch.equal(single, torch.zeros(1))
    # every sample its own group
    singles = estimator(torch.tensor([0.1, 5.0, -2.0]), torch.tensor([0, 1, 2]))
    assert torch.equal(singles, torch.zeros(3))
    # equal rewards: exactly 0 even where the float mean misses the value by an ulp (8 x 0.3 etc.)
    for value in (0.3, 0.1, 1 / 3, 0.7):
        same = estimator(torch.full((8,), value), torch.zeros(8, dtype=torch.long))
        assert torch.equal(same, torch.zeros(8)), (name, value, same)
    # two interleaved equal-reward groups
    two = estimator(torch.tensor([0.3, 0.7, 0.3, 0.7]), torch.tensor([5, 6, 5, 6]))
    assert torch.equal(two, torch.zeros(4))


@pytest.mark.parametrize("name", BUILT_INS)
def test_output_dtype_and_validation(name: str) -> None:
    estimator = ADVANTAGES.resolve(name)
    out = estimator(REWARDS.to(torch.float64), GROUPS)
    assert out.dtype == torch.float32 and out.shape == (8,)
    with pytest.raises(ValueError, match=r"\(3,\).*\(2,\)"):
        estimator(torch.zeros(3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\(2, 2\)"):
        estimator(torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"rewards\[2\] is nan"):
        estimator(torch.tensor([0.0, 1.0, float("nan"), 1.0]), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"rewards\[0\] is -inf"):
        estimator(torch.tensor([float("-inf"), 1.0]), torch.zeros(2, dtype=torch.long))


def test_registry() -> None:
    assert set(BUILT_INS) <= set(ADVANTAGES.names())
    assert ADVANTAGES.resolve("rloo") is rloo and ADVANTAGES.resolve("grpo") is grpo
    with pytest.raises(UnknownAlgorithmError, match="did you mean 'rloo'"):
        ADVANTAGES.resolve("rlo")
    user = ADVANTAGES.resolve("tests.algos.test_advantages:my_estimator")
    assert user is my_estimator
    torch.testing.assert_close(user(rewards=torch.tensor([1.0, 2.0]), group_ids=torch.tensor([0, 0])),
                               torch.tensor([2.0, 4.0]))
    with pytest.raises(UnknownAlgorithmError, match=r"no_group_ids.*lacks the parameter\(s\) group_ids"):
        ADVANTAGES.resolve("tests.algos.test_advantages:no_group_ids")
    with pytest.raises(UnknownAlgorithmError, match="no_group_ids"):
        ADVANTAGES.register("bad")(no_group_ids)
    assert "bad" not in ADVANTAGES


def _leave_one_out(rewards: list[float], groups: list[int]) -> list[float]:
    """r_i minus the mean of the other rewards of its group, in plain Python (0 for a group of one)."""
    out = []
    for i, (r, g) in enumerate(zip(rewards, groups, strict=True)):
        others = [rj for j, (rj, gj) in enumerate(zip(rewards, groups, strict=True)) if gj == g and j != i]
        out.append(r - sum(others) / len(others) if others else 0.0)
    return out


def _random_batch(gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """1-5 groups of 1-6 samples, arbitrary ids, interleaved; rewards sometimes binary (ties)."""
    n_groups = int(torch.randint(1, 6, (1,), generator=gen))
    ids = torch.randperm(1000, generator=gen)[:n_groups] - 500
    sizes = torch.randint(1, 7, (n_groups,), generator=gen)
    group_ids = torch.repeat_interleave(ids, sizes)
    n = group_ids.numel()
    if bool(torch.rand(1, generator=gen) < 0.5):
        rewards = torch.randint(0, 2, (n,), generator=gen).to(torch.float32)
    else:
        rewards = torch.randn(n, generator=gen) * 3.0
    order = torch.randperm(n, generator=gen)
    return rewards[order], group_ids[order]


def test_rloo_identity_on_random_inputs() -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        rewards, groups = _random_batch(gen)
        adv = rloo(rewards, groups)
        expected = torch.tensor(_leave_one_out(rewards.tolist(), groups.tolist()))
        torch.testing.assert_close(adv, expected, atol=1e-5, rtol=1e-5)
        # A = G / (G - 1) * (r - mean_g), for groups of G >= 2
        for g in groups.unique():
            mask = groups == g
            size = int(mask.sum())
            if size > 1:
                identity = size / (size - 1) * (rewards[mask] - rewards[mask].mean())
                torch.testing.assert_close(adv[mask], identity, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", BUILT_INS)
def test_properties_on_random_inputs(name: str) -> None:
    gen = torch.Generator().manual_seed(1234)
    estimator = ADVANTAGES.resolve(name)
    for _ in range(20):
        rewards, groups = _random_batch(gen)
        adv = estimator(rewards, groups)
        assert adv.dtype == torch.float32 and adv.shape == rewards.shape
        assert bool(torch.isfinite(adv).all())
        # equivariance: permuting the samples permutes the advantages
        perm = torch.randperm(rewards.numel(), generator=gen)
        torch.testing.assert_close(estimator(rewards[perm], groups[perm]), adv[perm], atol=1e-5, rtol=1e-5)
        if name != "reinforce_pp":  # its whitening is over the batch, not per group
            for g in groups.unique():
                assert abs(adv[groups == g].sum().item()) < 1e-4, (name, g)
        else:
            assert abs(adv.sum().item()) < 1e-4  # re-centred over the batch


def test_overlong_penalty_hand_computed() -> None:
    from streamrl.algos.shaping import overlong_penalty

    # 20 tokens allowed, the last 4 penalised: free up to 16, then -1/4 per token, -1 at 20 (and past it)
    assert [overlong_penalty(n, 20, 4) for n in (0, 16, 17, 18, 20, 25)] == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert overlong_penalty(18, 20, 4, penalty=0.5) == -0.25
    assert overlong_penalty(100, 20, 0) == 0.0  # off
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(5, 20, 21)
