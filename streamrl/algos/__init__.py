"""streamrl.algos: the algorithm pieces as pure tensor functions, in registries called by name."""

from streamrl.algos.advantages import ADVANTAGES
from streamrl.algos.aggregation import AGGREGATIONS, divides_by
from streamrl.algos.grpo import (
    LossConfig,
    aggregate_loss,
    group_advantages,
    loss_denominator,
    per_token_loss,
    unnormalized_loss,
)
from streamrl.algos.kl import KL_ESTIMATORS, kl_penalty
from streamrl.algos.losses import CORRECTIONS, POLICY_LOSSES
from streamrl.algos.registry import Registry, UnknownAlgorithmError

__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "CORRECTIONS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "LossConfig",
    "Registry",
    "UnknownAlgorithmError",
    "aggregate_loss",
    "divides_by",
    "group_advantages",
    "kl_penalty",
    "loss_denominator",
    "per_token_loss",
    "unnormalized_loss",
]
