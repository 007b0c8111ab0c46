"""What every reward backend returns, the policies that turn failures into results, and the errors.

Both backends (:class:`~streamrl.rewards.client.RewardClient` over ZeroMQ and
:class:`~streamrl.rewards.inprocess.InProcessRewardBackend`) satisfy :class:`RewardBackend`, so the
score stage switches between them with configuration only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol

import msgspec

from streamrl.rewards.protocol import RewardSample, Score, check_score

#: What the client does with a reply that is malformed or of the wrong shape (undecodable bytes,
#: wrong number of results, unknown sample ids, a score that is not a finite float / dict of floats):
#: "fail" raises :class:`RewardReplyError`; "retry" sends the batch to another server;
#: "default" scores the affected samples with ``default_score``.
OnBadReply = Literal["fail", "retry", "default"]
#: What a backend does with a sample whose reward function raised (or returned a non-score):
#: "fail" raises :class:`RewardSampleError`; "default" gives it ``default_score`` (error kept);
#: "keep" returns the result with ``score=None`` and the error, for the caller to decide.
OnSampleError = Literal["fail", "default", "keep"]

ON_BAD_REPLY_CHOICES: tuple[str, ...] = ("fail", "retry", "default")
ON_SAMPLE_ERROR_CHOICES: tuple[str, ...] = ("fail", "default", "keep")


class RewardResult(msgspec.Struct, frozen=True):
    """The reward of one sample, as delivered to the caller (exactly one per requested sample)."""

    sample_id: int
    #: None only when ``error`` is set and the policy is "keep".
    score: float | dict[str, float] | None
    #: Why the reward function failed for this sample, when it did.
    error: str | None = None
    #: Who produced the score: a server endpoint, "inprocess", or "default" (filled by a policy).
    source: str = ""
    #: How many requests it took (1 = first try); always 1 in process.
    attempts: int = 1


class RewardBackend(Protocol):
    """The score stage's view of a reward backend."""

    async def score(self, samples: Sequence[RewardSample]) -> list[RewardResult]: ...

    def statistics(self) -> Any: ...

    async def aclose(self) -> None: ...


class RewardError(Exception):
    """Base class of every error raised by streamrl.rewards."""


class RewardConfigError(RewardError, ValueError):
    """A backend or server was configured with an invalid value."""


class RewardFunctionLoadError(RewardError):
    """A ``module:function`` reward spec could not be imported or is not callable."""


class RewardSampleError(RewardError):
    """The reward function failed for some samples and the policy is ``on_sample_error="fail"``."""

    def __init__(self, failures: Sequence[RewardResult]) -> None:
        self.failures = list(failures)
        shown = "; ".join(f"sample {r.sample_id} on {r.source}: {r.error}" for r in self.failures[:5])
        more = f" (and {len(self.failures) - 5} more)" if len(self.failures) > 5 else ""
        super().__init__(
            f"reward function failed for {len(self.failures)} sample(s): {shown}{more}. Fix the reward "
            "function, or set on_sample_error='default' (score them with default_score) or 'keep'."
        )


class RewardReplyError(RewardError):
    """A server's reply was malformed or of the wrong shape and the policy is "fail"."""

    def __init__(self, server: str, sample_ids: Sequence[int], reason: str) -> None:
        self.server = server
        self.sample_ids = list(sample_ids)
        self.reason = reason
        super().__init__(
            f"reward server {server} sent a bad reply for samples {_ids(self.sample_ids)}: {reason}. "
            "Fix the server, or set on_bad_reply='retry' (use another server) or 'default' "
            "(score them with default_score)."
        )


class RewardRetriesExhaustedError(RewardError):
    """A batch failed on every attempt (timeouts, lost servers, bad replies with policy "retry")."""

    def __init__(self, sample_ids: Sequence[int], failures: Sequence[str]) -> None:
        self.sample_ids = list(sample_ids)
        self.failures = list(failures)
        super().__init__(
            f"samples {_ids(self.sample_ids)} could not be scored after {len(self.failures)} attempt(s): "
            + "; ".join(self.failures)
            + ". Raise timeout_s or max_attempts, or add reward servers."
        )


class RewardServersUnavailableError(RewardError):
    """No reward server could take a batch for ``no_server_timeout_s``."""


def _ids(ids: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(str(i) for i in ids[:limit])
    return f"[{shown}{', ...' if len(ids) > limit else ''}] ({len(ids)} total)"


def apply_sample_error_policy(
    results: list[RewardResult], policy: OnSampleError, default_score: Score, counts: dict[str, int]
) -> list[RewardResult]:
    """Resolve per-sample function errors according to ``policy`` (see :data:`OnSampleError`),
    adding to ``counts``' "samples", "sample_errors" and "defaulted_samples"."""
    failures = [r for r in results if r.error is not None]
    counts["samples"] += len(results)
    counts["sample_errors"] += len(failures)
    if not failures or policy == "keep":
        return results
    if policy == "fail":
        raise RewardSampleError(failures)
    counts["defaulted_samples"] += len(failures)
    return [msgspec.structs.replace(r, score=default_score) if r.error is not None else r for r in results]


def validate_policies(on_bad_reply: str | None, on_sample_error: str, default_score: object) -> None:
    """Check policy names and the default score once, at construction, with actionable messages."""
    if on_bad_reply is not None and on_bad_reply not in ON_BAD_REPLY_CHOICES:
        raise RewardConfigError(f"on_bad_reply={on_bad_reply!r}; choose one of {ON_BAD_REPLY_CHOICES}")
    if on_sample_error not in ON_SAMPLE_ERROR_CHOICES:
        raise RewardConfigError(
            f"on_sample_error={on_sample_error!r}; choose one of {ON_SAMPLE_ERROR_CHOICES}"
        )
    problem = check_score(default_score)
    if problem is not None:
        raise RewardConfigError(f"default_score={default_score!r} is invalid: {problem}")
