"""Loss aggregations against their formulas written out here, streamed in any split, and a user's
aggregation named as module:function."""

from __future__ import annotations

import math

import pytest
import torch

from streamrl.algos.aggregation import AGGREGATIONS, divides_by
from streamrl.algos.grpo import LossConfig, aggregate_loss, loss_denominator, unnormalized_loss

LENGTHS = [3, 1, 4, 2, 5]
USER = "tests.algos.user_algos:sqrt_length"


def _batch() -> tuple[torch.Tensor, torch.Tensor, list[list[float]]]:
    g = torch.Generator().manual_seed(0)
    per_token = torch.randn(sum(LENGTHS), generator=g, dtype=torch.float64)
    seq_index = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
    rows, start = [], 0
    for n in LENGTHS:
        rows.append(per_token[start:start + n].tolist())
        start += n
    return per_token, seq_index, rows


def _reference(mode: str, rows: list[list[float]], norm_tokens: int) -> float:
    """The formulas, one sequence at a time in plain Python."""
    tokens, seqs = sum(len(r) for r in rows), len(rows)
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / tokens
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows) / seqs
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in rows) / seqs
    if mode == "seq-mean-token-sum-norm":
        return sum(sum(r) for r in rows) / (seqs * norm_tokens)
    assert mode == USER
    return sum(sum(r) / math.sqrt(len(r)) for r in rows) / seqs


@pytest.mark.parametrize("mode", [*AGGREGATIONS.names(), USER])
def test_each_aggregation_is_its_formula_in_any_split(mode: str) -> None:
    per_token, seq_index, rows = _batch()
    want = _reference(mode, rows, norm_tokens=7)
    assert float(aggregate_loss(per_token, seq_index, len(LENGTHS), mode, 7)) == pytest.approx(want, abs=1e-6)
    for split in ([2, 3], [1, 1, 1, 1, 1], [5]):  # micro-batches of whole sequences, streamed
        total, first_seq, first_tok = 0.0, 0, 0
        for n in split:
            n_tok = sum(LENGTHS[first_seq:first_seq + n])
            idx = seq_index[first_tok:first_tok + n_tok] - first_seq
            total += float(unnormalized_loss(per_token[first_tok:first_tok + n_tok], idx, n, mode))
            first_seq, first_tok = first_seq + n, first_tok + n_tok
        assert total / loss_denominator(mode, len(per_token), len(LENGTHS), 7) == pytest.approx(want, abs=1e-6)


def test_every_builtin_is_registered() -> None:
    assert AGGREGATIONS.names() == sorted(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                           "seq-mean-token-sum-norm"])


def test_a_user_aggregation_is_checked_when_the_config_is_built() -> None:
    assert LossConfig(loss_agg=USER).loss_agg == USER
    with pytest.raises(ValueError, match=r"loss_agg: .*undeclared_aggregation.* says no denominator.*divides_by"):
        LossConfig(loss_agg="tests.algos.user_algos:undeclared_aggregation")
    with pytest.raises(ValueError, match=r"loss_agg: unknown loss aggregation 'token-man'; did you mean 'token-mean'"):
        LossConfig(loss_agg="token-man")
    with pytest.raises(ValueError, match=r"lacks the parameter\(s\) per_token, seq_index, n_seqs"):
        LossConfig(loss_agg="tests.algos.user_algos:constant")
    with pytest.raises(ValueError, match="denominator must be one of"):
        divides_by("words")  # type: ignore[arg-type]
