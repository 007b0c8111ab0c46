"""Per-token KL(current || reference) estimators from sampled-token log-probabilities.

With log r = ref - logp for a token drawn from the current policy (Schulman, "Approximating KL
divergence", 2020):
- k1 = -log r = logp - ref        unbiased, high variance, can be negative
- k2 = (log r)^2 / 2              biased, low variance, >= 0
- k3 = (r - 1) - log r            unbiased, low variance, >= 0 (GRPO / TRL default)
Gradients flow through ``logprobs`` only.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator = "k3") -> Tensor:
    """Per-token KL estimate [N] of the current policy from the reference."""
    log_ratio = ref_logprobs.detach() - logprobs
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio * log_ratio
    if estimator == "k3":
        return torch.exp(log_ratio) - log_ratio - 1.0
    raise ValueError(f"KL estimator {estimator!r} is not one of {list(KL_ESTIMATORS)}")
