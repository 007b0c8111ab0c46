"""streamrl.algos: GRPO / PPO-clip maths as pure tensor functions."""

from streamrl.algos.grpo import (
    LOSS_AGGREGATIONS,
    LossConfig,
    aggregate_loss,
    clipped_policy_loss,
    group_advantages,
    loss_denominator,
    per_token_loss,
    truncated_is_weights,
    unnormalized_loss,
)
from streamrl.algos.kl import KL_ESTIMATORS, kl_penalty

__all__ = [
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "LossConfig",
    "aggregate_loss",
    "clipped_policy_loss",
    "group_advantages",
    "kl_penalty",
    "loss_denominator",
    "per_token_loss",
    "truncated_is_weights",
    "unnormalized_loss",
]
