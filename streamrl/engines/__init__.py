"""streamrl.engines: built-in torch rollout (sampling) and train (GRPO gradients) engines."""

from streamrl.engines.rollout import GenerateArgumentError, Generation, TorchRolloutEngine, sample_tokens
from streamrl.engines.train import (
    NothingAccumulatedError,
    TorchLogprobEngine,
    TorchTrainEngine,
    TrainBatchError,
    TrainSample,
    samples_from_columns,
)

__all__ = [
    "GenerateArgumentError",
    "Generation",
    "NothingAccumulatedError",
    "TorchLogprobEngine",
    "TorchRolloutEngine",
    "TorchTrainEngine",
    "TrainBatchError",
    "TrainSample",
    "sample_tokens",
    "samples_from_columns",
]
