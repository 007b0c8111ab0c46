"""Allgather-swap resharding between the training and the inference layouts (see docs/reshard.md).

Layouts (:mod:`layout`), what to cut (:mod:`spec`, :mod:`shards`, and :mod:`fsdp_layout` for an
FSDP2 engine's placements), the process groups (:mod:`groups`), the bucketed reshard
(:mod:`resharder`), versioned inference weights (:mod:`weights`) and the awaitable policy objects
(:mod:`policy`). The train engine (``streamrl.engines.fsdp.FSDPTrainEngine``) and its
training-state swap (``offload_state`` / ``reload_state``) live outside this package.
"""

from streamrl.reshard.accounting import BucketStats, MemoryTracker, ReshardReport, SwapReport
from streamrl.reshard.daemon import DaemonCall
from streamrl.reshard.groups import RankGroups, TrainGroups, build_rank_groups
from streamrl.reshard.layout import InferenceLayout, LayoutError, Placement, Topology, TrainLayout
from streamrl.reshard.policy import (
    ColocatedPolicy,
    PhaseError,
    WeightChannelClosedError,
    WeightReceiver,
    WeightSender,
)
from streamrl.reshard.resharder import Bucket, ReshardConfig, Resharder, plan_buckets
from streamrl.reshard.shards import Block, shard_state, shard_tensor, train_block
from streamrl.reshard.spec import InferencePlan, ModelShardingSpec, ParamSpec, Piece, local_hf_views
from streamrl.reshard.tp_forward import rope_theta, tensor_parallel_logits
from streamrl.reshard.weights import (
    InferenceWeights,
    VersionError,
    WeightsStatistics,
    WeightsUnavailableError,
)

__all__ = [
    "Block",
    "Bucket",
    "BucketStats",
    "ColocatedPolicy",
    "DaemonCall",
    "InferenceLayout",
    "InferencePlan",
    "InferenceWeights",
    "LayoutError",
    "MemoryTracker",
    "ModelShardingSpec",
    "ParamSpec",
    "PhaseError",
    "Piece",
    "Placement",
    "RankGroups",
    "ReshardConfig",
    "ReshardReport",
    "Resharder",
    "SwapReport",
    "Topology",
    "TrainGroups",
    "TrainLayout",
    "VersionError",
    "WeightChannelClosedError",
    "WeightReceiver",
    "WeightSender",
    "WeightsStatistics",
    "WeightsUnavailableError",
    "build_rank_groups",
    "local_hf_views",
    "plan_buckets",
    "rope_theta",
    "shard_state",
    "shard_tensor",
    "tensor_parallel_logits",
    "train_block",
]
