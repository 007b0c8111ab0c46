"""A user's algorithm pieces, named from configs as ``tests.algos.user_algos:<function>``."""

from __future__ import annotations

import torch
from torch import Tensor


def constant(rewards: Tensor, group_ids: Tensor, value: float = 1.0) -> Tensor:
    """Every sample gets ``value``, whatever its reward: makes the trainer's loss's sign known."""
    return torch.full_like(rewards, value, dtype=torch.float32)


def squared_log_ratio(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """A KL estimator of one's own: (logp - ref)^2, the gradient through ``logprobs`` only."""
    return (logprobs - ref_logprobs.detach()) ** 2
