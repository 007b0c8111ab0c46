"""The training layout of an FSDP2 (x DTensor TP) model, read from its parameters' placements.

FSDP2 over a ``(dp,)`` mesh stores dim-0 shards (``torch.chunk`` rows: ceil(n / dp) per rank, the
last ranks shorter or empty); over ``(dp, tp)``, a parameter that TP split along dim d is first
cut into its TP chunk and that chunk is then sharded along dim 0 (placements ``(_StridedShard(0)
or Shard(0), Shard(d))``), and a parameter TP leaves whole is sharded over dp only. That is
exactly :mod:`streamrl.reshard.shards`'s layout with ``train_tp_dim = d`` (or None), with rank =
dp_rank * tp + tp_rank as the mesh numbers them, so the resharder can read ``to_local()`` as is.

What TP splits is the engine's choice (streamrl/engines/parallel.py: embeddings replicated),
not the spec's default (vocab-parallel embeddings, Megatron style): :func:`spec_for_placements`
takes each parameter's split dim from its placements, and refuses any placement this layout
cannot express instead of resharding wrong bytes.

A model with no DTensor parameter at all is the train engine's one-rank module, which it trains
unwrapped (streamrl/engines/fsdp.py): a layout of one rank that holds every parameter whole.
"""

from __future__ import annotations

import dataclasses

from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

from streamrl.reshard.layout import LayoutError, TrainLayout
from streamrl.reshard.spec import ModelShardingSpec


def _is_dim0_shard(placement: object) -> bool:
    # FSDP over a TP-sharded dim 0 places _StridedShard (a split factor; not a Shard subclass in torch 2.13)
    return isinstance(placement, Shard | _StridedShard) and placement.dim == 0


def train_tp_dims(model: nn.Module) -> tuple[TrainLayout, dict[str, int | None]]:
    """The train layout (R, tp) and the TP split dim of every parameter of an FSDP2 model (or of the
    train engine's unwrapped one-rank module: (1, 1), no split)."""
    dims: dict[str, int | None] = {}
    world = tp = None
    named = list(model.named_parameters())
    if named and not any(isinstance(p, DTensor) for _, p in named):
        return TrainLayout(1, 1), {name: None for name, _ in named}
    for name, p in named:
        if not isinstance(p, DTensor):
            raise LayoutError(f"{name} is not a DTensor while other parameters are: the model is partly "
                              "sharded with FSDP2 (fully_shard every decoder layer and the root)")
        mesh, placements = p.device_mesh, p.placements
        names = mesh.mesh_dim_names or ()
        if names == ("dp",) and len(placements) == 1 and _is_dim0_shard(placements[0]):
            dims[name] = None
            continue
        if names == ("dp", "tp") and len(placements) == 2 and _is_dim0_shard(placements[0]):
            inner = placements[1]
            if isinstance(inner, Shard):
                dims[name] = inner.dim
            elif isinstance(inner, Replicate):
                dims[name] = None
            else:
                raise LayoutError(f"{name}: tp placement {inner} has no reshard layout")
            world, tp = mesh.size(), mesh.size(1)
            continue
        raise LayoutError(f"{name}: placements {placements} over mesh {names} have no reshard layout "
                          "(expected FSDP2 dim-0 shards over 'dp', optionally x a 'tp' split)")
    if world is None:
        first = next(iter(model.parameters()))
        world, tp = first.device_mesh.size(), 1  # type: ignore[attr-defined]
    assert tp is not None
    return TrainLayout(world, tp), dims


def spec_for_placements(spec: ModelShardingSpec, model: nn.Module) -> tuple[ModelShardingSpec, TrainLayout]:
    """``spec`` with each parameter's ``train_tp_dim`` as the FSDP2 model really holds it, and the layout."""
    layout, dims = train_tp_dims(model)
    missing = [p.name for p in spec.params if p.name not in dims]
    if missing:
        raise LayoutError(f"the model has no parameters {missing[:3]} of the sharding spec")
    params = tuple(dataclasses.replace(p, train_tp_dim=dims[p.name]) for p in spec.params)
    out = dataclasses.replace(spec, params=params)
    out.check_train_layout(layout)
    return out, layout
