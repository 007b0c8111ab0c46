"""The policy objective as pure tensor functions: GRPO advantages, the per-token loss, aggregation.

Conventions: per-token tensors are flat [N] over all response tokens of a (micro-)batch, with
``seq_index`` [N] saying which sequence each token belongs to (0..S-1). Log-probabilities are of
the sampled tokens under log_softmax(logits / temperature).

Streaming: the train engine does not know how many tokens/sequences the optimizer step will
hold until its last micro-batch. So ``unnormalized_loss`` returns a *sum* whose gradient is
accumulated as micro-batches arrive, and ``loss_denominator`` gives what to divide the summed
gradient by at the step. Sum-then-divide equals computing the loss on the whole batch at once,
for every aggregation mode, whatever the split.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import msgspec
import torch
from msgspec import Meta
from torch import Tensor

from streamrl.algos.aggregation import AGGREGATIONS, denominator_of, denominator_value
from streamrl.algos.kl import KL_ESTIMATORS, kl_penalty
from streamrl.algos.losses import CORRECTIONS, POLICY_LOSSES
from streamrl.algos.registry import UnknownAlgorithmError

# a name in streamrl.algos.aggregation.AGGREGATIONS (token-mean, seq-mean-token-mean,
# seq-mean-token-sum, seq-mean-token-sum-norm) or a user's module:function
LossAggregation = str


class LossConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Hyper-parameters of the policy objective (validated at construction).

    Defaults are TRL GRPOTrainer's (loss_type "dapo" = token-mean, epsilon 0.2, beta 0).
    ``policy_loss`` and ``correction`` name functions of :mod:`streamrl.algos.losses`'
    registries (or a user's ``module:function``); the trainer calls them and knows no algorithm.
    """

    policy_loss: Annotated[str, Meta(description=(
        "The per-token policy loss: ppo_clip (PPO's clipped ratio; clip_high > clip_low = DAPO's clip-higher), "
        "gspo (sequence-level ratio), cispo (clipped importance weight times logprob), or module:function "
        "(docs/algorithms.md)"))] = "ppo_clip"
    dual_clip: Annotated[float | None, Meta(description=(
        "Dual-clip PPO's c (> 1): a token with negative advantage loses at most c x |advantage|, so a huge "
        "ratio on an off-policy token cannot dominate the step; null = off"))] = None

    clip_low: Annotated[float, Meta(description=(
        "The ratio's floor is 1 - clip_low (PPO epsilon), in [0, 1]; 1 = no floor (CISPO)"))] = 0.2
    clip_high: Annotated[float, Meta(description=(
        "The ratio's ceiling is 1 + clip_high; above clip_low = DAPO's clip-higher"))] = 0.2
    kl_coef: Annotated[float, Meta(description=(
        "Weight of the per-token KL penalty against the reference policy; 0 = off (> 0 needs a pipeline with "
        "a reference stage, e.g. pipelines/grpo_kl.yaml)"))] = 0.0
    kl_in: Annotated[Literal["loss", "reward"], Meta(description=(
        "Where the KL penalty goes: loss (kl_coef x each token's KL added to the policy loss, as GRPO) or "
        "reward (kl_coef x a response's summed KL, from its rollout logprobs, subtracted from its reward "
        "before the advantage, as PPO and REINFORCE++: the advantage stage then reads ref_logprobs and "
        "rollout_logprobs)"))] = "loss"
    kl_estimator: Annotated[str, Meta(description=(
        "k1: log-ratio, k2: squared log-ratio / 2, k3: Schulman's unbiased estimator, or module:function "
        "(docs/algorithms.md)"))] = "k3"
    loss_agg: Annotated[LossAggregation, Meta(description=(
        "How per-token losses become one number per step: token-mean (mean over all its tokens), "
        "seq-mean-token-mean (mean over sequences of each one's token mean), seq-mean-token-sum (mean over "
        "sequences of each one's token sum), seq-mean-token-sum-norm (Dr.GRPO: token sums over a constant, "
        "sequences x norm_tokens, so a sequence's length does not scale its tokens' weight), or "
        "module:function (docs/algorithms.md)"))] = "token-mean"
    norm_tokens: Annotated[int | None, Meta(description=(
        "The constant token count of seq-mean-token-sum-norm (tokens); null = algo.max_new_tokens"))] = None
    correction: Annotated[str, Meta(description=(
        "Off-policy correction when the trainer recomputed old logprobs and they differ from the behaviour "
        "(rollout) ones (off-policy samples, or an inference engine whose numerics differ): tis (truncated "
        "importance weight min(exp(old - rollout), is_cap)), mis (masked: tokens whose weight exceeds is_cap "
        "are dropped) or module:function"))] = "tis"
    is_cap: Annotated[float | None, Meta(description=(
        "The importance weight's cap of the correction; null = no correction"))] = 2.0
    temperature: Annotated[float, Meta(description=(
        "Sampling temperature; logprobs are recomputed at the same one (leave it out: it must equal "
        "algo.temperature)"))] = 1.0
    entropy_coef: Annotated[float, Meta(description=(
        "Entropy bonus: the per-token loss minus this x the policy's entropy at the token (keeps exploration "
        "up); 0 = off. > 0 costs the entropy's backward through the vocabulary"))] = 0.0
    compute_entropy: Annotated[bool, Meta(description=(
        "Report the policy's mean entropy (costs one pass over the vocabulary)"))] = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.clip_low <= 1.0:
            raise ValueError(f"LossConfig.clip_low must be in [0, 1] (1: no floor), got {self.clip_low}")
        if not self.clip_high >= 0.0:
            raise ValueError(f"LossConfig.clip_high must be >= 0, got {self.clip_high}")
        if not (self.entropy_coef >= 0.0 and math.isfinite(self.entropy_coef)):
            raise ValueError(f"LossConfig.entropy_coef must be a finite number >= 0, got {self.entropy_coef}")
        if not (self.kl_coef >= 0.0 and math.isfinite(self.kl_coef)):
            raise ValueError(f"LossConfig.kl_coef must be a finite number >= 0, got {self.kl_coef}")
        if self.is_cap is not None and not self.is_cap > 0.0:
            raise ValueError(f"LossConfig.is_cap must be > 0 or None (no correction), got {self.is_cap}")
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ValueError(f"LossConfig.dual_clip must be > 1 (e.g. 3.0) or None (off), got {self.dual_clip}")
        if self.norm_tokens is not None and self.norm_tokens < 1:
            raise ValueError(f"LossConfig.norm_tokens must be >= 1 or None (algo.max_new_tokens), got {self.norm_tokens}")
        for name, registry in (("policy_loss", POLICY_LOSSES), ("correction", CORRECTIONS),
                               ("kl_estimator", KL_ESTIMATORS), ("loss_agg", AGGREGATIONS)):
            try:
                registry.resolve(getattr(self, name))
            except UnknownAlgorithmError as exc:
                raise ValueError(f"LossConfig.{name}: {exc}") from None
        try:
            denominator_of(self.loss_agg)
        except ValueError as exc:
            raise ValueError(f"LossConfig.loss_agg: {exc}") from None
        if not self.temperature > 0.0:
            raise ValueError(f"LossConfig.temperature must be > 0, got {self.temperature}")

    @property
    def kl_in_loss(self) -> bool:
        """The trainer adds kl_coef x each token's KL to the loss."""
        return self.kl_coef > 0.0 and self.kl_in == "loss"

    @property
    def kl_in_reward(self) -> bool:
        """The advantage stage takes kl_coef x each response's summed KL from its reward."""
        return self.kl_coef > 0.0 and self.kl_in == "reward"


def group_advantages(
    rewards: Tensor, group_ids: Tensor, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """GRPO advantages: reward minus its group's mean, divided by the group's std (+ eps).

    ``rewards`` [N] float, ``group_ids`` [N] int (any values; equal id = same prompt). The std is
    the unbiased one (as TRL); a group of one sample has advantage 0. A group whose rewards are
    all equal gets exactly 0: its float mean can miss the common value by an ulp, and dividing
    that residue by a tiny std + eps would invent an advantage (e.g. 0.03 for eight 0.3s).
    """
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must be equal 1-D")
    rewards = rewards.to(torch.float32)
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    n_groups = counts.numel()
    sums = torch.zeros(n_groups, dtype=rewards.dtype, device=rewards.device).index_add_(0, inverse, rewards)
    means = sums / counts
    lowest = torch.full_like(sums, float("inf")).scatter_reduce_(0, inverse, rewards, "amin")
    highest = torch.full_like(sums, float("-inf")).scatter_reduce_(0, inverse, rewards, "amax")
    centred = torch.where((highest == lowest)[inverse], 0.0, rewards - means[inverse])
    if not normalize_std:
        return centred
    sq = torch.zeros_like(sums).index_add_(0, inverse, centred * centred)
    std = torch.sqrt(sq / (counts - 1).clamp(min=1))
    return centred / (std[inverse] + eps)


def zero_at_zero_advantage(config: LossConfig) -> bool:
    """Whether a sample with advantage 0 has exactly zero loss and gradient under ``config``: true
    for the built-in policy losses without a KL term or an entropy bonus, so the trainer may skip such samples (a
    GRPO group whose rewards are all equal costs nothing). A user's loss is always computed."""
    return not config.kl_in_loss and config.entropy_coef == 0.0 and config.policy_loss in ZERO_AT_ZERO_ADVANTAGE


ZERO_AT_ZERO_ADVANTAGE = frozenset({"ppo_clip", "gspo", "cispo"})


def per_token_loss(
    logprobs: Tensor,
    advantages: Tensor,
    config: LossConfig,
    *,
    seq_index: Tensor | None = None,
    entropy: Tensor | None = None,
    old_logprobs: Tensor | None = None,
    rollout_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The per-token loss of ``config.policy_loss`` and per-token statistics (all [N]).

    ``advantages`` is per token (a sequence's scalar repeated); ``seq_index`` says which sequence
    each token is of (default: one sequence). The ratio is taken against ``old_logprobs`` when
    given (trainer recomputation), else against ``rollout_logprobs``, else against the detached
    current logprobs (single on-policy update, ratio 1, as TRL with num_iterations=1). With both
    old and rollout logprobs and ``config.is_cap`` set, the loss is weighted per token by
    ``config.correction``'s importance weights; with ``ref_logprobs``, ``kl_coef`` > 0 and
    ``kl_in`` loss the KL penalty is added (``kl_in`` reward: the advantage stage took it from the
    reward, :func:`kl_reward_penalty`); with ``config.entropy_coef`` > 0, ``entropy`` [N] (with its graph) times the
    coefficient is subtracted (the entropy bonus).
    """
    stats: dict[str, Tensor] = {}
    is_weights = None
    if seq_index is None:
        seq_index = torch.zeros_like(logprobs, dtype=torch.long)
    if old_logprobs is not None:
        if rollout_logprobs is not None and config.is_cap is not None:
            correct = CORRECTIONS.resolve(config.correction)
            is_weights = correct(old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs, cap=config.is_cap)
            stats["is_weight"] = is_weights
        behaviour = old_logprobs
    elif rollout_logprobs is not None:
        behaviour = rollout_logprobs
    else:
        behaviour = logprobs.detach()
    policy_loss = POLICY_LOSSES.resolve(config.policy_loss)
    loss, clipped = policy_loss(logprobs=logprobs, old_logprobs=behaviour, advantages=advantages,
                                seq_index=seq_index, config=config)
    if is_weights is not None:
        loss = loss * is_weights
    stats["clipped"] = clipped.to(torch.float32)
    delta = (logprobs - behaviour).detach()
    stats["approx_kl"] = 0.5 * delta * delta  # KL(behaviour || current), second-order estimate
    if ref_logprobs is not None:
        kl = kl_penalty(logprobs, ref_logprobs, config.kl_estimator)
        stats["kl"] = kl.detach()
        if config.kl_in_loss:
            loss = loss + config.kl_coef * kl
    elif config.kl_in_loss:
        raise ValueError("LossConfig.kl_coef > 0 needs ref_logprobs for every sample (run the reference stage)")
    if config.entropy_coef > 0.0:
        if entropy is None:
            raise ValueError("LossConfig.entropy_coef > 0 needs the per-token entropy (with its graph)")
        loss = loss - config.entropy_coef * entropy
    return loss, stats


def kl_reward_penalty(rollout_logprobs: Tensor, ref_logprobs: Tensor, coef: float,
                      estimator: str = "k1") -> float:
    """What KL in the reward takes from one response's reward: ``coef`` x the sum over its tokens
    of the KL estimate of the behaviour policy (its rollout logprobs) from the reference [R]."""
    return coef * float(kl_penalty(rollout_logprobs.float(), ref_logprobs.float(), estimator).sum())


def unnormalized_loss(per_token: Tensor, seq_index: Tensor, n_seqs: int, mode: LossAggregation) -> Tensor:
    """A scalar *sum* to backpropagate: the aggregation ``mode``'s (streamrl.algos.aggregation);
    divide its gradient by ``loss_denominator`` at the step."""
    return AGGREGATIONS.resolve(mode)(per_token=per_token, seq_index=seq_index, n_seqs=n_seqs)


def loss_denominator(mode: LossAggregation, tokens: int, sequences: int, norm_tokens: int = 1) -> int:
    """What the summed loss/gradient of a whole optimizer step is divided by (``norm_tokens``:
    seq-mean-token-sum-norm's constant)."""
    return denominator_value(denominator_of(mode), tokens, sequences, norm_tokens)


def aggregate_loss(per_token: Tensor, seq_index: Tensor, n_seqs: int, mode: LossAggregation,
                   norm_tokens: int = 1) -> Tensor:
    """The normalised loss of a whole batch at once (reference for the streamed form)."""
    denominator = loss_denominator(mode, per_token.numel(), n_seqs, norm_tokens)
    return unnormalized_loss(per_token, seq_index, n_seqs, mode) / max(denominator, 1)
