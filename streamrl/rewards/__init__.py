"""External and in-process reward scoring: the protocol, servers, client and keys.

The score stage uses a :class:`RewardBackend`: :class:`RewardClient` (``backend: zmq``, external
reward servers, docs/reward-protocol.md) or :class:`InProcessRewardBackend` (``backend: inprocess``).
"""

from streamrl.rewards.client import (
    RewardClient,
    RewardClientStatistics,
    RewardEndpoint,
    ServerStatistics,
)
from streamrl.rewards.function import RewardFunction, batched, load_reward_function
from streamrl.rewards.inprocess import InProcessRewardBackend, InProcessStatistics
from streamrl.rewards.protocol import PROTOCOL_VERSIONS, RewardSample
from streamrl.rewards.results import (
    OnBadReply,
    OnSampleError,
    RewardBackend,
    RewardConfigError,
    RewardError,
    RewardFunctionLoadError,
    RewardReplyError,
    RewardResult,
    RewardRetriesExhaustedError,
    RewardSampleError,
    RewardServersUnavailableError,
)
from streamrl.rewards.server import RewardServer, RewardServerStatistics

__all__ = [
    "PROTOCOL_VERSIONS",
    "InProcessRewardBackend",
    "InProcessStatistics",
    "OnBadReply",
    "OnSampleError",
    "RewardBackend",
    "RewardClient",
    "RewardClientStatistics",
    "RewardConfigError",
    "RewardEndpoint",
    "RewardError",
    "RewardFunction",
    "RewardFunctionLoadError",
    "RewardReplyError",
    "RewardResult",
    "RewardRetriesExhaustedError",
    "RewardSample",
    "RewardSampleError",
    "RewardServer",
    "RewardServerStatistics",
    "RewardServersUnavailableError",
    "ServerStatistics",
    "batched",
    "load_reward_function",
]
