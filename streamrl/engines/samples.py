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
    # the sequence's advantage (every token's), or one per response token [R] (e.g. GAE)
    advantage: float | Tensor
    rollout_logprobs: Tensor | None = None  # [R] behaviour logprobs from the generator
    old_logprobs: Tensor | None = None  # [R] recomputed by the trainer (optional)
    ref_logprobs: Tensor | None = None  # [R] reference policy (needed when kl_coef > 0)
    # [R] 1 on the tokens the policy sampled, 0 on tokens it did not (a multi-turn trajectory's tool
    # output and template tokens between its generated segments): only 1-tokens are in the loss and
    # its token counts. None: every response token is trained.
    loss_mask: Tensor | None = None

    def trained_tokens(self) -> int:
        """How many response tokens are in the loss."""
        if self.loss_mask is None:
            return self.response_ids.numel()
        return int(self.loss_mask.to(torch.bool).sum())

    def token_advantages(self) -> Tensor:
        """The advantage of every response token [R] (a sequence's advantage repeated)."""
        if isinstance(self.advantage, Tensor):
            return self.advantage.to(torch.float32)
        return torch.full((self.response_ids.numel(),), float(self.advantage), dtype=torch.float32)

    def has_signal(self) -> bool:
        """Whether a trained token has a nonzero advantage (else its policy-loss gradient is zero)."""
        if not isinstance(self.advantage, Tensor):
            return self.advantage != 0.0 and self.trained_tokens() > 0
        adv = self.advantage if self.loss_mask is None else self.advantage[self.loss_mask.to(torch.bool)]
        return bool((adv != 0).any())


TRAIN_COLUMNS = ("prompt_ids", "response_ids", "advantage", "rollout_logprobs", "old_logprobs", "ref_logprobs",
                 "loss_mask")


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

    def advantage(i: int) -> float | Tensor:
        value = columns["advantage"][i]
        if isinstance(value, Tensor):
            return value
        if isinstance(value, list | tuple):  # per token, as a list
            return torch.tensor(value, dtype=torch.float32)
        return float(value)  # type: ignore[arg-type]

    return [
        TrainSample(
            prompt_ids=columns["prompt_ids"][i],  # type: ignore[arg-type]
            response_ids=columns["response_ids"][i],  # type: ignore[arg-type]
            advantage=advantage(i),
            rollout_logprobs=opt("rollout_logprobs", i),
            old_logprobs=opt("old_logprobs", i),
            ref_logprobs=opt("ref_logprobs", i),
            loss_mask=opt("loss_mask", i),
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
    n = s.response_ids.numel()
    if isinstance(s.advantage, Tensor):
        if s.advantage.dim() != 1 or not s.advantage.is_floating_point() or s.advantage.numel() != n:
            raise TrainBatchError(f"sample {i}: a per-token advantage must be a 1-D float tensor with one value per "
                                  f"response token ({n}), got {_describe(s.advantage)}")
        if not bool(torch.isfinite(s.advantage).all()):
            raise TrainBatchError(f"sample {i}: advantage has non-finite values")
    elif not math.isfinite(s.advantage):
        raise TrainBatchError(f"sample {i}: advantage is {s.advantage}")
    if s.loss_mask is not None:
        m = s.loss_mask
        if not isinstance(m, Tensor) or m.dim() != 1 or m.numel() != n:
            raise TrainBatchError(f"sample {i}: loss_mask must be a 1-D tensor with one value per response token "
                                  f"({n}), got {_describe(m)}")
        if not bool(((m == 0) | (m == 1)).all()):
            raise TrainBatchError(f"sample {i}: loss_mask must hold only 0 and 1")
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
    norm_tokens: int | None = None  # seq-mean-token-sum-norm's constant (None: nothing accumulated yet)
