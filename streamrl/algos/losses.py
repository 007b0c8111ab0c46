"""Policy losses and off-policy corrections, as registries of pure per-token tensor functions.

Conventions (as ``streamrl.algos.grpo``): per-token tensors are flat [N] over all response tokens
of a micro-batch; ``seq_index`` [N] (integer) says which sequence (0..S-1) each token belongs to.

``POLICY_LOSSES``: ``fn(logprobs=, old_logprobs=, advantages=, seq_index=, config=)`` returns
``(loss [N], clipped [N] bool)``: the per-token loss, before importance weights, KL and
aggregation (the caller's job), and which tokens were clipped (no gradient from the ratio).

``CORRECTIONS``: ``fn(old_logprobs=, rollout_logprobs=, cap=)`` returns per-token importance
weights [N] without gradient, for when the trainer's old logprobs differ from the generator's.

A config may name a built-in (``"gspo"``) or any function as ``module:function``; see
``streamrl.algos.registry``. This module must not import ``streamrl.algos.grpo`` (that one
imports this).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from streamrl.algos.registry import Registry

__all__ = [
    "CORRECTIONS",
    "POLICY_LOSSES",
    "ClipConfig",
    "CorrectionFn",
    "PolicyLossFn",
    "cispo",
    "clipped_value_loss",
    "gspo",
    "masked_is",
    "ppo_clip",
    "truncated_is",
]


class ClipConfig(Protocol):
    """What a policy loss reads from its config (read-only, so frozen structs fit).

    ``clip_low``/``clip_high``: the ratio is clipped to [1 - clip_low, 1 + clip_high].
    ``dual_clip``: c > 1 caps the loss of negative-advantage tokens at c·|A| (``ppo_clip`` only);
    None = off.
    """

    @property
    def clip_low(self) -> float: ...

    @property
    def clip_high(self) -> float: ...

    @property
    def dual_clip(self) -> float | None: ...


PolicyLossFn = Callable[..., tuple[Tensor, Tensor]]
CorrectionFn = Callable[..., Tensor]

POLICY_LOSSES: Registry[PolicyLossFn] = Registry(
    "policy loss", ("logprobs", "old_logprobs", "advantages", "seq_index", "config"))
CORRECTIONS: Registry[CorrectionFn] = Registry(
    "off-policy correction", ("old_logprobs", "rollout_logprobs", "cap"))


def _check_flat(what: str, **tensors: Tensor) -> None:
    """ValueError unless all ``tensors`` are 1-D of one shape (naming every shape)."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1 or any(len(s) != 1 for s in shapes.values()):
        listed = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
        raise ValueError(f"{what}: inputs must be 1-D tensors of one shape [N], got {listed}")


# ------------------------------------------------------------------------------------------------
# Policy losses
# ------------------------------------------------------------------------------------------------


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, seq_index: Tensor, config: ClipConfig
) -> tuple[Tensor, Tensor]:
    """Token-level PPO-clip: max(-A·r, -A·clip(r, 1-clip_low, 1+clip_high)), r = exp(logp - old).

    ``clip_high > clip_low`` is DAPO's clip-higher. With ``config.dual_clip = c`` (c > 1; Ye et
    al. 2020, dual-clip PPO), a token with A < 0 has its loss capped at c·|A| (min(loss, -A·c)),
    so a huge ratio on a bad token cannot blow up the step; capped tokens count as clipped.
    ``seq_index`` is unused.
    """
    _check_flat("ppo_clip", logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
                seq_index=seq_index)
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped_branch = -advantages * torch.clamp(ratio, 1.0 - config.clip_low, 1.0 + config.clip_high)
    loss = torch.maximum(unclipped, clipped_branch)
    clipped = clipped_branch > unclipped
    dual = config.dual_clip
    if dual is not None:
        if not dual > 1.0:
            raise ValueError(f"ppo_clip: dual_clip must be > 1 or None, got {dual}")
        ceiling = -advantages * dual
        capped = (advantages < 0) & (loss > ceiling)
        loss = torch.where(capped, ceiling, loss)
        clipped = clipped | capped
    return loss, clipped.detach()


@POLICY_LOSSES.register("gspo")
def gspo(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, seq_index: Tensor, config: ClipConfig
) -> tuple[Tensor, Tensor]:
    """GSPO-token (Zheng et al. 2025, Group Sequence Policy Optimization): a sequence-level ratio.

    s_i = exp(mean over sequence i's tokens of (logp - old)), the length-normalised sequence
    likelihood ratio; per token s_{i,t} = sg[s_i]·exp(logp_t - sg[logp_t]), whose value is s_i and
    whose gradient is s_i·∇logp_t. loss_t = max(-A_t·s_{i,t}, -A_t·clip(s_{i,t}, 1-clip_low,
    1+clip_high)); clipped where the clipped branch is the larger one (whole sequences clip
    together when A is per sequence).

    Aggregated as seq-mean-token-mean (each sequence's token mean, 1/|y_i|), the gradient equals
    the sequence-level GSPO objective's: -A_i·s_i·(1/|y_i|)·Σ_t ∇logp_t. With per-token
    advantages A_t this is GSPO-token; with a sequence's A repeated it is GSPO itself.

    Because s_i is a geometric mean of per-token ratios it stays very close to 1: the paper's clip
    ranges are tiny, e.g. clip_low = 3e-4, clip_high = 4e-4 (not PPO's 0.2). ``dual_clip`` is
    ignored. The per-sequence mean is accumulated in at least float32.
    """
    _check_flat("gspo", logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
                seq_index=seq_index)
    if seq_index.is_floating_point() or seq_index.dtype == torch.bool:
        raise ValueError(f"gspo: seq_index must be an integer tensor, got {seq_index.dtype}")
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    log_ratio = (logprobs.detach() - old_logprobs.detach()).to(dtype)
    lengths = torch.bincount(seq_index)  # [S]; S = max index + 1 (0 for no tokens)
    sums = torch.zeros(lengths.numel(), dtype=dtype, device=logprobs.device).index_add_(0, seq_index, log_ratio)
    seq_ratio = torch.exp(sums / lengths.clamp(min=1).to(dtype))  # s_i, no gradient
    token_ratio = seq_ratio[seq_index] * torch.exp(logprobs - logprobs.detach()).to(dtype)
    unclipped = -advantages * token_ratio
    clipped_branch = -advantages * torch.clamp(token_ratio, 1.0 - config.clip_low, 1.0 + config.clip_high)
    loss = torch.maximum(unclipped, clipped_branch)
    return loss, (clipped_branch > unclipped).detach()


@POLICY_LOSSES.register("cispo")
def cispo(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, seq_index: Tensor, config: ClipConfig
) -> tuple[Tensor, Tensor]:
    """CISPO (MiniMax-M1, 2025): clip the importance-sampling weight, not the update.

    loss_t = -sg[clip(r_t, 1-clip_low, 1+clip_high)]·A_t·logp_t, r_t = exp(logp_t - old_t). The
    gradient, -w_t·A_t·∇logp_t, flows through ``logprobs`` only, never through the weight, so
    unlike PPO-clip no token loses its gradient (rare, high-ratio "fork" tokens keep learning);
    ``clipped`` marks the tokens whose weight was clipped. The loss's *value* is a surrogate (only
    its gradient means something). MiniMax-M1 effectively leaves the floor off (a large
    clip_low) and tunes only clip_high. ``seq_index`` and ``dual_clip`` are unused.
    """
    _check_flat("cispo", logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
                seq_index=seq_index)
    ratio = torch.exp(logprobs.detach() - old_logprobs.detach())
    low, high = 1.0 - config.clip_low, 1.0 + config.clip_high
    weight = torch.clamp(ratio, low, high)
    loss = -weight * advantages * logprobs
    return loss, ((ratio < low) | (ratio > high)).detach()


# ------------------------------------------------------------------------------------------------
# Off-policy corrections
# ------------------------------------------------------------------------------------------------


@CORRECTIONS.register("tis")
def truncated_is(old_logprobs: Tensor, rollout_logprobs: Tensor, cap: float) -> Tensor:
    """Truncated importance sampling: min(exp(old - rollout), cap) per token, no gradient.

    Used when the sample was generated by a different policy than the trainer's "old" one: the
    generator's weights lag (off-policy / asynchronous samples), or the inference engine's
    numerics differ from the trainer's (other kernels, precision, batch-variant reductions), so
    the logprobs it returned are not the trainer's. Weighting by the ratio corrects the bias;
    truncating at ``cap`` bounds the variance (a little bias remains).
    """
    _check_flat("tis", old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs)
    if not cap > 0.0:
        raise ValueError(f"tis: cap must be > 0, got {cap}")
    return torch.exp(old_logprobs - rollout_logprobs).clamp(max=cap).detach()


@CORRECTIONS.register("mis")
def masked_is(old_logprobs: Tensor, rollout_logprobs: Tensor, cap: float) -> Tensor:
    """Masked importance sampling: exp(old - rollout) where it is <= cap, else 0, no gradient.

    For the same mismatches as ``tis`` (off-policy samples; inference/training numerics), but a
    token whose ratio exceeds ``cap`` is dropped from the loss (weight 0) rather than kept at
    weight ``cap``: such a token is most likely a numerical outlier of the generator (the trainer
    finds it far likelier than the generator claimed), and truncating would still train on it.
    """
    _check_flat("mis", old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs)
    if not cap > 0.0:
        raise ValueError(f"mis: cap must be > 0, got {cap}")
    ratio = torch.exp(old_logprobs - rollout_logprobs).detach()
    return torch.where(ratio <= cap, ratio, torch.zeros_like(ratio))


def clipped_value_loss(values: Tensor, old_values: Tensor, returns: Tensor, clip: float | None
                       ) -> tuple[Tensor, Tensor]:
    """PPO's clipped value loss per token (the critic's): max((V - R)^2, (clip(V, V_old ± c) - R)^2).

    ``values`` [N] the critic's prediction now (with gradient), ``old_values`` [N] its prediction
    when the advantages were computed (the value stage's), ``returns`` [N] the targets (GAE's).
    The clip keeps one step from moving a value far from the one the advantages used; ``clip``
    None = plain squared error. Returns (loss [N], clipped [N] bool: the clipped term was the larger).
    """
    unclipped = (values - returns) ** 2
    if clip is None:
        return unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    clipped = (clipped_values - returns) ** 2
    return torch.maximum(unclipped, clipped), clipped > unclipped
