"""Loss aggregations: how per-token losses become one number per optimizer step, registered by
name in ``AGGREGATIONS`` (``algo.loss.loss_agg``).

A step's micro-batches arrive one at a time, on several ranks, so an aggregation is split in two
parts that stream:

- the function, ``fn(per_token=[T], seq_index=[T], n_seqs=S) -> scalar``: a micro-batch's *sum*,
  backpropagated at once (the gradients of the step's micro-batches add up). It may weigh a token
  only by what its own sequence holds (e.g. 1 / its length), never by the rest of the micro-batch,
  so any split of the step into micro-batches and ranks gives the same update;
- its ``denominator`` (an attribute, set by the :func:`divides_by` decorator): what the step's
  summed gradient is divided by, counted over the whole step and every rank: ``tokens`` (trained
  response tokens), ``sequences``, or ``sequences_x_norm_tokens`` (sequences times
  ``algo.loss.norm_tokens``, Dr.GRPO's constant).

``seq_index[t]`` is the sequence (0..S-1) token ``t`` belongs to. A user's aggregation is named as
``module:function`` and decorated the same way (docs/algorithms.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, TypeAlias, TypeVar, get_args

import torch
from torch import Tensor

from streamrl.algos.registry import Registry

Denominator = Literal["tokens", "sequences", "sequences_x_norm_tokens"]
DENOMINATORS: tuple[str, ...] = get_args(Denominator)

# (per_token: Tensor [T], seq_index: Tensor [T] int, n_seqs: int) -> Tensor [] (the micro-batch's sum)
Aggregation: TypeAlias = Callable[..., Tensor]
A = TypeVar("A", bound=Callable[..., Any])

AGGREGATIONS: Registry[Aggregation] = Registry("loss aggregation", ("per_token", "seq_index", "n_seqs"))


def divides_by(denominator: Denominator) -> Callable[[A], A]:
    """Mark an aggregation with what the step's summed loss is divided by."""
    if denominator not in DENOMINATORS:
        raise ValueError(f"an aggregation's denominator must be one of {list(DENOMINATORS)}, got {denominator!r}")

    def mark(fn: A) -> A:
        fn.denominator = denominator  # type: ignore[attr-defined]
        return fn

    return mark


def denominator_of(name: str) -> Denominator:
    """The denominator kind of the aggregation ``name`` (registered or ``module:function``)."""
    fn = AGGREGATIONS.resolve(name)
    kind = getattr(fn, "denominator", None)
    if kind not in DENOMINATORS:
        raise ValueError(f"loss aggregation {name!r} says no denominator (got {kind!r}): decorate it with "
                         f"@streamrl.algos.aggregation.divides_by(...), one of {list(DENOMINATORS)}")
    return kind  # type: ignore[no-any-return]


def denominator_value(kind: str, tokens: int, sequences: int, norm_tokens: int = 1) -> int:
    """A denominator kind's value for a step of ``tokens`` trained tokens and ``sequences``."""
    if kind == "tokens":
        return tokens
    if kind == "sequences":
        return sequences
    if kind == "sequences_x_norm_tokens":
        return sequences * norm_tokens
    raise ValueError(f"unknown denominator {kind!r}; one of {list(DENOMINATORS)}")


def _lengths(seq_index: Tensor, n_seqs: int) -> Tensor:
    return torch.bincount(seq_index, minlength=n_seqs).to(torch.float32)


@AGGREGATIONS.register("token-mean")
@divides_by("tokens")
def token_mean(per_token: Tensor, seq_index: Tensor, n_seqs: int) -> Tensor:
    """Σ_t ℓ_t / tokens: every token of the step weighs the same (TRL's and DAPO's default)."""
    return per_token.sum()


@AGGREGATIONS.register("seq-mean-token-mean")
@divides_by("sequences")
def seq_mean_token_mean(per_token: Tensor, seq_index: Tensor, n_seqs: int) -> Tensor:
    """Σ_s mean_t ℓ_st / sequences: every sequence weighs the same (GRPO's paper, RLOO, GSPO).
    An empty sequence adds 0."""
    lengths = _lengths(seq_index, n_seqs).clamp(min=1.0)
    return (per_token / lengths[seq_index]).sum()


@AGGREGATIONS.register("seq-mean-token-sum")
@divides_by("sequences")
def seq_mean_token_sum(per_token: Tensor, seq_index: Tensor, n_seqs: int) -> Tensor:
    """Σ_s Σ_t ℓ_st / sequences: a sequence weighs as many tokens as it has."""
    return per_token.sum()


@AGGREGATIONS.register("seq-mean-token-sum-norm")
@divides_by("sequences_x_norm_tokens")
def seq_mean_token_sum_norm(per_token: Tensor, seq_index: Tensor, n_seqs: int) -> Tensor:
    """Σ_s Σ_t ℓ_st / (sequences × norm_tokens): Dr.GRPO's constant normaliser, so a sequence's
    length does not scale its tokens' weight."""
    return per_token.sum()
