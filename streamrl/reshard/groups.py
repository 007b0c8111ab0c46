"""The torch.distributed process groups a topology needs, and this rank's role in them.

``new_group`` is collective over the whole world, so :func:`build_rank_groups` must be called
by every process of the world, in the same order, after ``init_process_group``. Groups of one
rank are not created (``None``): a collective over one rank is a no-op we simply skip.

The reshard gets its *own* process group over the train ranks (``reshard_group``), separate
from the engine's: a reshard runs its collectives in a worker thread, and collectives on one
group issued from two threads could interleave differently on different ranks and deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from streamrl.reshard.layout import LayoutError, Topology, TrainLayout

ProcessGroup = dist.ProcessGroup


@dataclass(frozen=True)
class TrainGroups:
    """What the sharded train engine needs: its coordinates and its groups (None = size 1)."""

    layout: TrainLayout
    rank: int  # rank inside the train group
    group: ProcessGroup | None  # all train ranks
    dp_group: ProcessGroup | None  # the R // P ranks sharing this rank's TP chunk
    tp_group: ProcessGroup | None  # the P ranks of this rank's TP group

    @property
    def dp_rank(self) -> int:
        return self.layout.coords(self.rank)[0]

    @property
    def tp_rank(self) -> int:
        return self.layout.coords(self.rank)[1]


@dataclass(frozen=True)
class RankGroups:
    """This process's roles under a topology."""

    topology: Topology
    world_rank: int
    train: TrainGroups | None  # None on a disaggregated generation worker
    reshard_group: ProcessGroup | None  # train ranks only; dedicated to reshard collectives
    inference_rank: int | None  # tp rank t in the inference layout, None on a pure train rank
    inference_replica: int | None
    inference_group: ProcessGroup | None  # the T ranks of this replica (TP forward); None if T == 1
    weight_source: int | None  # disaggregated generation worker: world rank that feeds it
    weight_destinations: tuple[int, ...]  # disaggregated train rank: world ranks it feeds
    weight_group: ProcessGroup | None = None  # disaggregated: whole world, point-to-point weights only

    @property
    def is_train(self) -> bool:
        return self.train is not None

    @property
    def is_generation(self) -> bool:
        return self.inference_rank is not None


def _new_group(ranks: tuple[int, ...]) -> ProcessGroup | None:
    group = dist.new_group(ranks=list(ranks))
    return group if len(ranks) > 1 else None


def build_rank_groups(topology: Topology) -> RankGroups:
    """Create every group of ``topology`` (collective over the world) and return this rank's roles."""
    if not dist.is_initialized():
        raise RuntimeError("build_rank_groups needs torch.distributed.init_process_group to run first")
    world, me = dist.get_world_size(), dist.get_rank()
    if world != topology.world_size:
        raise LayoutError(
            f"the torch.distributed world has {world} processes but the topology needs "
            f"{topology.world_size} ({topology.placement}: R={topology.train.world_size}, "
            f"T={topology.inference.tensor_parallel}, replicas={topology.inference.replicas})"
        )
    layout = topology.train
    R, P, dp = layout.world_size, layout.tensor_parallel, layout.data_parallel
    train_ranks = tuple(topology.train_ranks)
    # Fixed creation order: every rank walks the same list.
    train_group = _new_group(train_ranks)
    reshard_group = _new_group(train_ranks)
    dp_groups = [_new_group(tuple(layout.rank_of(d, t) for d in range(dp))) for t in range(P)]
    tp_groups = [_new_group(tuple(layout.rank_of(d, t) for t in range(P))) for d in range(dp)]
    inference_groups = [
        _new_group(topology.inference_group_ranks(k)) for k in range(topology.inference.replicas)
    ]
    weight_group = _new_group(tuple(range(world))) if topology.placement == "disaggregated" else None

    train: TrainGroups | None = None
    if me < R:
        dp_rank, tp_rank = layout.coords(me)
        train = TrainGroups(layout, me, train_group, dp_groups[tp_rank], tp_groups[dp_rank])
    inference_rank = replica = source = None
    inference_group = None
    if me in topology.generation_ranks:
        inference_rank, replica = topology.inference_coords(me)
        inference_group = inference_groups[replica]
        if topology.placement == "disaggregated":
            source = topology.weight_source(me)
    destinations = topology.weight_destinations(me) if me < R else ()
    return RankGroups(
        topology,
        me,
        train,
        reshard_group if me < R else None,
        inference_rank,
        replica,
        inference_group,
        source,
        destinations,
        weight_group,
    )
