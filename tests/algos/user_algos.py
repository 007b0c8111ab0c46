"""A user's algorithm pieces, named from configs as ``tests.algos.user_algos:<function>``."""

from __future__ import annotations

import torch
from torch import Tensor

from streamrl.algos.aggregation import divides_by


def constant(rewards: Tensor, group_ids: Tensor, value: float = 1.0) -> Tensor:
    """Every sample gets ``value``, whatever its reward: makes the trainer's loss's sign known."""
    return torch.full_like(rewards, value, dtype=torch.float32)


def squared_log_ratio(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """A KL estimator of one's own: (logp - ref)^2, the gradient through ``logprobs`` only."""
    return (logprobs - ref_logprobs.detach()) ** 2


@divides_by("sequences")
def sqrt_length(per_token: Tensor, seq_index: Tensor, n_seqs: int) -> Tensor:
    """A loss aggregation of one's own: each sequence's token sum over sqrt(its length), averaged over
    sequences (between seq-mean-token-sum and seq-mean-token-mean)."""
    lengths = torch.bincount(seq_index, minlength=n_seqs).clamp(min=1).to(per_token.dtype)
    return (per_token / lengths.sqrt()[seq_index]).sum()


def undeclared_aggregation(per_token: Tensor, seq_index: Tensor, n_seqs: int) -> Tensor:
    """An aggregation without @divides_by: refused, it does not say its denominator."""
    return per_token.sum()


def reinforce(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, seq_index: Tensor,
              config: object) -> tuple[Tensor, Tensor]:
    """A policy loss of one's own: plain REINFORCE, -A·logp per token, nothing clipped."""
    return -advantages * logprobs, torch.zeros_like(logprobs, dtype=torch.bool)
