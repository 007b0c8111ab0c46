"""Per-token KL(current || reference) estimators from sampled-token log-probabilities, in a registry.

With log r = ref - logp for a token drawn from the current policy (Schulman, "Approximating KL
divergence", 2020):
- k1 = -log r = logp - ref        unbiased, high variance, can be negative
- k2 = (log r)^2 / 2              biased, low variance, >= 0
- k3 = (r - 1) - log r            unbiased, low variance, >= 0 (GRPO / TRL default)
Gradients flow through ``logprobs`` only. ``algo.loss.kl_estimator`` names one of these or a
user's ``module:function`` called as ``fn(logprobs=[N], ref_logprobs=[N]) -> [N]``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from streamrl.algos.registry import Registry

KLEstimatorFn = Callable[..., Tensor]
KL_ESTIMATORS: Registry[KLEstimatorFn] = Registry("KL estimator", ("logprobs", "ref_logprobs"))


@KL_ESTIMATORS.register("k1")
def k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """logp - ref: unbiased, high variance, can be negative."""
    return logprobs - ref_logprobs.detach()


@KL_ESTIMATORS.register("k2")
def k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """(ref - logp)^2 / 2: biased, low variance, >= 0."""
    log_ratio = ref_logprobs.detach() - logprobs
    return 0.5 * log_ratio * log_ratio


@KL_ESTIMATORS.register("k3")
def k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """exp(ref - logp) - (ref - logp) - 1: unbiased, low variance, >= 0."""
    log_ratio = ref_logprobs.detach() - logprobs
    return torch.exp(log_ratio) - log_ratio - 1.0


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token KL estimate [N] of the current policy from the reference, by ``estimator``'s name."""
    return KL_ESTIMATORS.resolve(estimator)(logprobs=logprobs, ref_logprobs=ref_logprobs)
