"""streamrl.engines: the rollout engine (sampling), the FSDP2 train engine and the reference's logprob engine."""

from streamrl.engines.logprob import LogprobEngine
from streamrl.engines.rollout import GenerateArgumentError, Generation, TorchRolloutEngine, sample_tokens
from streamrl.engines.samples import (
    NothingAccumulatedError,
    TrainBatchError,
    TrainSample,
    samples_from_columns,
)

__all__ = [
    "GenerateArgumentError",
    "Generation",
    "LogprobEngine",
    "NothingAccumulatedError",
    "TorchRolloutEngine",
    "TrainBatchError",
    "TrainSample",
    "sample_tokens",
    "samples_from_columns",
]
