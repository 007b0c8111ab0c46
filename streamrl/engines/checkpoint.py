"""Sharded checkpoints of an FSDP2 train engine with ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a DCP directory holding the model's and AdamW's sharded state (DTensors keyed
by parameter name, so it does not depend on the world that wrote it) and the engine's step
count. Every rank writes its own shards and reads what its new layout needs: a checkpoint
saved at R ranks loads at any other R (and tensor-parallel size); DCP reshards on load.

The step is stored as a tensor, not a Python int: DCP would pickle a plain object into the
checkpoint's data files (its ``.metadata`` index is torch's own pickle either way).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from streamrl.engines.fsdp import FSDPTrainEngine


class CheckpointError(RuntimeError):
    """A checkpoint directory is missing, incomplete or does not match the engine's model."""


def _state(engine: FSDPTrainEngine) -> dict[str, object]:
    model, optimizer = get_state_dict(engine.model, engine.optimizer)
    return {"model": model, "optimizer": optimizer, "engine": {"steps": torch.tensor(engine.steps)}}


def save_checkpoint(engine: FSDPTrainEngine, path: str | Path, process_group: dist.ProcessGroup | None = None
                    ) -> Path:
    """Write model, optimizer and step to the DCP directory ``path`` (collective; every rank writes).

    Call it between steps: gradients accumulated since the last step are not part of it.
    ``process_group``: the engine's ranks when the default group holds more (the disaggregated
    placement's generate ranks); None = the default group.
    """
    engine.check_on_device()
    path = Path(path)
    dcp.save(_state(engine), checkpoint_id=str(path), process_group=process_group)
    return path


def load_checkpoint(engine: FSDPTrainEngine, path: str | Path, process_group: dist.ProcessGroup | None = None
                    ) -> int:
    """Load model, optimizer and step from ``path`` into ``engine`` (collective); returns the step.

    The engine must wrap the same architecture; its world size and tensor-parallel size may
    differ from the saving run's.
    """
    engine.check_on_device()
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise CheckpointError(
            f"{str(path)!r} is not a DCP checkpoint (no .metadata); pass a directory written by save_checkpoint"
        )
    # AdamW creates its moments lazily; get_state_dict initialises them (a zero-lr step) so that
    # DCP has tensors of the right layout to load into, but only when no gradient is pending:
    # drop any first (they belong to the weights being replaced anyway).
    engine.zero_grad()
    state = _state(engine)
    try:
        dcp.load(state, checkpoint_id=str(path), process_group=process_group)
    except Exception as exc:  # DCP raises CheckpointException and others; name the path once
        raise CheckpointError(
            f"could not load checkpoint {str(path)!r} into {type(engine.model).__name__}: {type(exc).__name__}: {exc}"
        ) from exc
    set_state_dict(engine.model, engine.optimizer, model_state_dict=state["model"],  # type: ignore[arg-type]
                   optim_state_dict=state["optimizer"])  # type: ignore[arg-type]
    engine.steps = int(state["engine"]["steps"])  # type: ignore[index]
    return engine.steps
