"""Who holds what: the training layout, the inference layout and how their ranks map onto processes.

A *train group* of R processes holds the policy. Inside it, P-way tensor parallelism splits the
linear layers (column- and row-parallel, Megatron style) and the R // P data-parallel ranks then
shard each TP chunk along dim 0 (FSDP2 style). Ranks are numbered with TP fastest:
``rank = dp_rank * P + tp_rank``, so the P ranks of one TP group are neighbours (on a GPU node
they share the fast links).

The *inference layout* is T-way tensor parallelism, repeated ``replicas`` times for data-parallel
generation. Where those inference ranks live is the *placement*:

- ``colocated``: the train processes themselves generate between training phases. Process r is
  inference rank ``r % T`` of replica ``r // T``, so T must divide R (one inference rank per
  process and device) and there are R // T replicas.
- ``disaggregated``: T * replicas separate generation processes follow the R train processes in
  the world (world ranks R .. R + T * replicas - 1). Any T works: generation worker g is fed by
  train rank ``g % R``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Placement = Literal["colocated", "disaggregated"]
PLACEMENTS: tuple[Placement, ...] = ("colocated", "disaggregated")


class LayoutError(ValueError):
    """A layout the reshard cannot serve. The message names the field and how to fix it."""


@dataclass(frozen=True)
class TrainLayout:
    """How the train group shards the policy.

    world_size: R, processes in the train group.
    tensor_parallel: P, tensor-parallel degree inside the train group (1 = pure FSDP-style
        sharding). The remaining R // P ranks shard every TP chunk along dim 0.
    """

    world_size: int
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise LayoutError(f"train world_size must be an integer >= 1, got {self.world_size!r}")
        if not isinstance(self.tensor_parallel, int) or self.tensor_parallel < 1:
            raise LayoutError(f"train tensor_parallel must be an integer >= 1, got {self.tensor_parallel!r}")
        if self.world_size % self.tensor_parallel:
            raise LayoutError(
                f"train tensor_parallel={self.tensor_parallel} must divide train world_size="
                f"{self.world_size}: the data-parallel degree is world_size // tensor_parallel"
            )

    @property
    def data_parallel(self) -> int:
        return self.world_size // self.tensor_parallel

    def coords(self, rank: int) -> tuple[int, int]:
        """(dp_rank, tp_rank) of a train rank."""
        self._check_rank(rank)
        return divmod(rank, self.tensor_parallel)

    def rank_of(self, dp_rank: int, tp_rank: int) -> int:
        return dp_rank * self.tensor_parallel + tp_rank

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"train rank {rank} is outside the train group of size {self.world_size}")


@dataclass(frozen=True)
class InferenceLayout:
    """tensor_parallel: T, the inference TP degree. replicas: data-parallel copies of the T ranks."""

    tensor_parallel: int
    replicas: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.tensor_parallel, int) or self.tensor_parallel < 1:
            raise LayoutError(
                f"inference tensor_parallel must be an integer >= 1, got {self.tensor_parallel!r}"
            )
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise LayoutError(f"inference replicas must be an integer >= 1, got {self.replicas!r}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.replicas


@dataclass(frozen=True)
class Topology:
    """Train layout + inference layout + placement: everything needed to map ranks to roles.

    Build it with :meth:`colocated` or :meth:`disaggregated`; both validate and refuse an
    unsupported combination with a :class:`LayoutError` that says what to change.
    """

    placement: Placement
    train: TrainLayout
    inference: InferenceLayout

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise LayoutError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.placement == "colocated":
            R, T = self.train.world_size, self.inference.tensor_parallel
            if R % T:
                raise LayoutError(
                    f"placement 'colocated' needs inference tensor_parallel (T={T}) to divide the train "
                    f"world_size (R={R}): every train process hosts exactly one inference rank. "
                    f"Use T in {_divisors(R)} or placement 'disaggregated' for T={T}."
                )
            if self.inference.replicas != R // T:
                raise LayoutError(
                    f"placement 'colocated' with R={R}, T={T} has R // T = {R // T} inference replicas, "
                    f"got replicas={self.inference.replicas}; build it with Topology.colocated(...)"
                )

    @classmethod
    def colocated(cls, train: TrainLayout, inference_tensor_parallel: int) -> Topology:
        T = inference_tensor_parallel
        replicas = train.world_size // T if T >= 1 and train.world_size % T == 0 else 1
        return cls("colocated", train, InferenceLayout(T, replicas))

    @classmethod
    def disaggregated(cls, train: TrainLayout, inference_tensor_parallel: int, replicas: int = 1) -> Topology:
        return cls("disaggregated", train, InferenceLayout(inference_tensor_parallel, replicas))

    # -- rank maps ------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Processes in the torch.distributed world that this topology spans."""
        if self.placement == "colocated":
            return self.train.world_size
        return self.train.world_size + self.inference.world_size

    @property
    def train_ranks(self) -> range:
        return range(self.train.world_size)

    @property
    def generation_ranks(self) -> range:
        """World ranks that hold an inference rank."""
        if self.placement == "colocated":
            return range(self.train.world_size)
        R = self.train.world_size
        return range(R, R + self.inference.world_size)

    def inference_coords(self, world_rank: int) -> tuple[int, int]:
        """(inference tp rank, replica) of a generation world rank."""
        if world_rank not in self.generation_ranks:
            raise LayoutError(f"world rank {world_rank} holds no inference rank in {self}")
        index = world_rank - self.generation_ranks.start
        replica, tp_rank = divmod(index, self.inference.tensor_parallel)
        return tp_rank, replica

    def inference_group_ranks(self, replica: int) -> tuple[int, ...]:
        start = self.generation_ranks.start + replica * self.inference.tensor_parallel
        return tuple(range(start, start + self.inference.tensor_parallel))

    def weight_source(self, world_rank: int) -> int:
        """Disaggregated: the train rank that sends this generation worker its slices."""
        if self.placement != "disaggregated":
            raise LayoutError("weight_source only exists in placement 'disaggregated'")
        index = world_rank - self.generation_ranks.start
        if not 0 <= index < self.inference.world_size:
            raise LayoutError(f"world rank {world_rank} is not a generation worker in {self}")
        return index % self.train.world_size

    def weight_destinations(self, train_rank: int) -> tuple[int, ...]:
        """Disaggregated: generation world ranks this train rank feeds (round robin)."""
        if self.placement != "disaggregated":
            return ()
        self.train._check_rank(train_rank)
        return tuple(g for g in self.generation_ranks if self.weight_source(g) == train_rank)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
