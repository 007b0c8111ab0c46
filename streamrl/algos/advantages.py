"""Advantage estimators as pure tensor functions, registered by name in ``ADVANTAGES``.

An estimator is called as ``fn(rewards=..., group_ids=..., **options)``: ``rewards`` [N] float
(one scalar per sample, i.e. per response), ``group_ids`` [N] int (any values; equal id = the
same prompt's group; groups may be interleaved in any order). It returns the per-sample
advantages [N] float32 on the rewards' device; the trainer repeats each over its tokens. Options
are keyword parameters with defaults (e.g. ``eps``), passed by name.

An estimator sees one micro-batch made of *whole* groups: the advantage stage claims a prompt's
group only once all its samples have arrived, so a group is never split across calls. Anything
computed "over the batch" (e.g. REINFORCE++'s whitening) is therefore over what one call sees,
not over the whole optimizer step.

Conventions shared by the built-ins: a group of one sample gets advantage 0, and a group whose
rewards are all equal gets exactly 0 (not an ulp of float residue scaled up). Equivariance:
permuting the samples permutes the advantages. A user estimator may be named in a config as
``module:function``; ``ADVANTAGES.resolve`` checks that it accepts ``rewards`` and ``group_ids``.

Per-token estimators (``gae``) also name a ``values`` parameter: a list of N per-token value
tensors [R_i] from the critic (the value stage's ``values`` column). They return a pair
``(advantages, returns)``, each a list of N per-token tensors [R_i]; the critic trains towards
the returns. :func:`takes_values` tells the two kinds apart (the advantage stage and the
pre-run checks use it).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import TypeAlias

import torch
from torch import Tensor

from streamrl.algos.grpo import group_advantages
from streamrl.algos.registry import Registry

# (rewards: Tensor [N] float, group_ids: Tensor [N] int, **options) -> Tensor [N] float32.
# A Callable alias rather than a Protocol: a Protocol with **options would not match estimators
# whose options are named parameters (eps=1e-6), which every built-in is.
AdvantageEstimator: TypeAlias = Callable[..., Tensor]

ADVANTAGES: Registry[AdvantageEstimator] = Registry("advantage estimator", ("rewards", "group_ids"),
                                                    optional=("values",))


def takes_values(estimator: Callable[..., object]) -> bool:
    """Whether ``estimator`` is per-token: it names a ``values`` parameter (so it needs a critic)."""
    try:
        return "values" in inspect.signature(estimator).parameters
    except (TypeError, ValueError):
        return False


def check_inputs(rewards: Tensor, group_ids: Tensor) -> None:
    """Raise ValueError unless rewards and group_ids are equal-shape 1-D and every reward is finite."""
    if rewards.dim() != 1 or rewards.shape != group_ids.shape:
        raise ValueError(
            f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must be equal-shape 1-D tensors")
    bad = torch.nonzero(~torch.isfinite(rewards)).flatten()
    if bad.numel():
        index = int(bad[0])
        raise ValueError(f"rewards[{index}] is {rewards[index].item()}, not a finite number "
                         f"({bad.numel()} non-finite reward(s) in all)")


def _group_sizes(group_ids: Tensor) -> Tensor:
    """Per sample, the size G of its group (float32)."""
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    return counts[inverse].to(torch.float32)


@ADVANTAGES.register("grpo")
def grpo(rewards: Tensor, group_ids: Tensor, eps: float = 1e-6) -> Tensor:
    """A_i = (r_i - mean_g) / (std_g + eps), std unbiased; GRPO (Shao et al. 2024, DeepSeekMath)."""
    check_inputs(rewards, group_ids)
    return group_advantages(rewards, group_ids, normalize_std=True, eps=eps)


@ADVANTAGES.register("dr_grpo")
def dr_grpo(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """A_i = r_i - mean_g, no std division; Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training")."""
    check_inputs(rewards, group_ids)
    return group_advantages(rewards, group_ids, normalize_std=False)


@ADVANTAGES.register("rloo")
def rloo(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """A_i = r_i - mean_{j≠i in g} r_j = G/(G-1) · (r_i - mean_g); RLOO (Ahmadian et al. 2024, after Kool et al. 2019).

    A group of one sample (no other sample to be a baseline) gets 0.
    """
    check_inputs(rewards, group_ids)
    centred = group_advantages(rewards, group_ids, normalize_std=False)  # exactly 0 for equal rewards
    sizes = _group_sizes(group_ids).to(centred.device)
    return centred * (sizes / (sizes - 1.0).clamp(min=1.0))  # G = 1: centred is 0, the factor 1


@ADVANTAGES.register("reinforce_pp")
def reinforce_pp(rewards: Tensor, group_ids: Tensor, eps: float = 1e-6) -> Tensor:
    """c_i = r_i - mean_g; A = (c / (std(c) + eps)) - mean(·) over the batch; REINFORCE++-baseline (Hu et al. 2025).

    std is the population one over all N centred values. The "batch" here is what one call sees
    (the whole groups of one micro-batch), not the whole optimizer step as in the paper. If every
    centred value is 0 (all groups equal-reward or single) the result is exactly 0.
    """
    check_inputs(rewards, group_ids)
    centred = group_advantages(rewards, group_ids, normalize_std=False)
    if not bool(centred.ne(0).any()):
        return torch.zeros_like(centred)
    scaled = centred / (centred.std(correction=0) + eps)
    return scaled - scaled.mean()


@ADVANTAGES.register("gae")
def gae(rewards: Tensor, group_ids: Tensor, values: Sequence[Tensor], gamma: float = 1.0, lam: float = 0.95,
        whiten: bool = False, eps: float = 1e-8) -> tuple[list[Tensor], list[Tensor]]:
    """Generalised advantage estimation (Schulman et al. 2016) per response token, as PPO for LLMs runs it.

    A response of T tokens is an episode whose only reward, the sequence's, comes after its last
    token: r_t = 0 for t < T-1, r_{T-1} = reward. With V_T = 0 (the episode ends):
    delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}, returns_t = A_t + V_t
    (the critic's regression target). gamma = lam = 1 gives A_t = reward - V_t. ``whiten``:
    shift and scale the advantages of every token of the call to mean 0, std 1 (the returns are
    computed before it). ``group_ids`` are not used: the baseline is the critic's, not a group's.
    Returns (advantages, returns), lists of float32 tensors [T_i].
    """
    check_inputs(rewards, group_ids)
    if len(values) != rewards.numel():
        raise ValueError(f"{len(values)} value tensors for {rewards.numel()} rewards; one per sample")
    lengths = [int(v.numel()) for v in values]
    if not lengths:
        return [], []
    # padded [N, T]: a pad position has reward 0 and value 0, so its delta and advantage stay 0 and
    # the last real token sees V_T = 0
    padded = torch.nn.utils.rnn.pad_sequence([v.reshape(-1).to(torch.float32) for v in values], batch_first=True)
    if not bool(torch.isfinite(padded).all()):
        raise ValueError("values hold non-finite numbers")
    n, width = padded.shape
    token_rewards = torch.zeros_like(padded)
    ends = torch.tensor(lengths) - 1
    has_tokens = ends >= 0
    token_rewards[torch.arange(n)[has_tokens], ends[has_tokens]] = rewards.to(torch.float32)[has_tokens]
    next_values = torch.cat([padded[:, 1:], torch.zeros(n, 1)], dim=1)
    deltas = token_rewards + gamma * next_values - padded
    advantages = torch.zeros_like(padded)
    running = torch.zeros(n)
    for t in range(width - 1, -1, -1):
        running = deltas[:, t] + gamma * lam * running
        advantages[:, t] = running
    returns = advantages + padded
    mask = torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    if whiten and int(mask.sum()) > 1:
        kept = advantages[mask]
        advantages = torch.where(mask, (advantages - kept.mean()) / (kept.std(correction=0) + eps), 0.0)
    return ([a[:length] for a, length in zip(advantages, lengths, strict=True)],
            [r[:length] for r, length in zip(returns, lengths, strict=True)])
