"""What a train engine consumes: one completion to learn from, and the checks on it.

Samples arrive from the dock as columns (``samples_from_columns``); every engine checks them with
``check_sample`` so a malformed row is named before any compute, and keeps its running sums of a
step in a ``StepSums`` (the step's denominators are only known after its last micro-batch).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


class TrainBatchError(ValueError):
    """A micro-batch sample is malformed; the message names the sample and the field."""


class NothingAccumulatedError(RuntimeError):
    """``step`` was called before any ``accumulate``."""


@dataclass(frozen=True, slots=True)
class TrainSample:
    """One completion to learn from (tensors on any device; 1-D)."""

    prompt_ids: Tensor  # [P] int64
    response_ids: Tensor  # [R] int64, EOS included when it was sampled
    advantage: float  # the sequence's (group-normalised) advantage
    rollout_logprobs: Tensor | None = None  # [R] behaviour logprobs from the generator
    old_logprobs: Tensor | None = None  # [R] recomputed by the trainer (optional)
    ref_logprobs: Tensor | None = None  # [R] reference policy (needed when kl_coef > 0)


TRAIN_COLUMNS = ("prompt_ids", "response_ids", "advantage", "rollout_logprobs", "old_logprobs", "ref_logprobs")


def samples_from_columns(columns: Mapping[str, Sequence[object]]) -> list[TrainSample]:
    """Build samples from dock columns (name -> one value per sample); absent optional columns = None."""
    for name in ("prompt_ids", "response_ids", "advantage"):
        if name not in columns:
            raise TrainBatchError(f"column {name!r} is missing; the train stage must read {list(TRAIN_COLUMNS)[:3]}")
    n = len(columns["prompt_ids"])
    for name, values in columns.items():
        if name in TRAIN_COLUMNS and len(values) != n:
            raise TrainBatchError(f"column {name!r} has {len(values)} values, prompt_ids has {n}")

    def opt(name: str, i: int) -> Tensor | None:
        values = columns.get(name)
        return None if values is None else values[i]  # type: ignore[return-value]

    return [
        TrainSample(
            prompt_ids=columns["prompt_ids"][i],  # type: ignore[arg-type]
            response_ids=columns["response_ids"][i],  # type: ignore[arg-type]
            advantage=float(columns["advantage"][i]),  # type: ignore[arg-type]
            rollout_logprobs=opt("rollout_logprobs", i),
            old_logprobs=opt("old_logprobs", i),
            ref_logprobs=opt("ref_logprobs", i),
        )
        for i in range(n)
    ]


def check_sample(i: int, s: TrainSample) -> None:
    for name in ("prompt_ids", "response_ids"):
        t = getattr(s, name)
        if not isinstance(t, Tensor) or t.dim() != 1 or t.dtype != torch.int64:
            raise TrainBatchError(f"sample {i}: {name} must be a 1-D int64 tensor, got {_describe(t)}")
    if s.prompt_ids.numel() == 0:
        raise TrainBatchError(f"sample {i}: prompt_ids is empty")
    if not math.isfinite(s.advantage):
        raise TrainBatchError(f"sample {i}: advantage is {s.advantage}")
    n = s.response_ids.numel()
    for name in ("rollout_logprobs", "old_logprobs", "ref_logprobs"):
        t = getattr(s, name)
        if t is None:
            continue
        if not isinstance(t, Tensor) or t.dim() != 1 or not t.is_floating_point() or t.numel() != n:
            raise TrainBatchError(
                f"sample {i}: {name} must be a 1-D float tensor with one value per response token ({n}), "
                f"got {_describe(t)}"
            )


def _describe(t: object) -> str:
    if isinstance(t, Tensor):
        return f"{t.dtype} tensor of shape {tuple(t.shape)}"
    return type(t).__name__


@dataclass
class StepSums:
    """Running sums over the micro-batches of the current optimizer step."""

    loss: float = 0.0
    tokens: int = 0
    sequences: int = 0
    micro_batches: int = 0
    clipped: float = 0.0
    approx_kl: float = 0.0
    entropy: float = 0.0
    kl: float = 0.0
    kl_tokens: int = 0
    is_weight: float = 0.0
    is_tokens: int = 0
    skipped_tokens: int = 0  # zero-advantage samples: counted in the denominators, not computed
    skipped_sequences: int = 0
    mode: str | None = None
