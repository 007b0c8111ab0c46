"""Joining the torch.distributed world of a stage's workers: backend, device per rank, rendezvous.

The train stage's R workers (and, in the disaggregated placement, the generate stage's workers
after them) join one world through a FileStore in ``<run_dir>/rendezvous/<train stage>``; the
FSDP2 mesh, the reshard's groups and the weight channel are built over it.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import anyio
import torch
import torch.distributed as dist

from streamrl.models.device import resolve_device
from streamrl.reshard import DaemonCall, RankGroups, Topology, build_rank_groups
from streamrl.runtime.pipeline import StageSpec
from streamrl.runtime.rendezvous import connect_store
from streamrl.runtime.stage import StageContext


def default_backend(device: str) -> str:
    """The torch.distributed backend for a device ("auto" resolved): nccl on CUDA, hccl on Ascend NPU
    (registered by torch_npu), else gloo."""
    kind = resolve_device(device).type
    return {"cuda": "nccl", "npu": "hccl"}.get(kind, "gloo")


def rank_device(device: str, world_rank: int, world_size: int, backend: str) -> str:
    """This rank's device in a reshard world of ``world_size`` processes on this machine.

    An accelerator named without an index (``cuda``, ``npu``, or ``auto`` resolving to one) becomes
    ``<kind>:<world_rank mod device count>``, so the ranks spread over the machine's devices; an
    explicit index, or cpu, is kept. nccl and hccl need one device per rank: more ranks than
    devices is refused with what to change.
    """
    d = resolve_device(device)
    if d.type == "cpu":
        return "cpu"
    count = int(getattr(torch, d.type).device_count())
    if backend in ("nccl", "hccl") and world_size > count:
        raise ValueError(f"{world_size} reshard ranks (train + generation workers) but {count} {d.type} device(s): "
                         f"{backend} needs one device per rank; use fewer workers, or options.backend: gloo on "
                         "the train stage")
    return str(d) if d.index is not None else f"{d.type}:{world_rank % count}"


async def join_world(ctx: StageContext, store_name: str, rank: int, world_size: int,
                     topology: Topology | None, *,
                     backend: str, timeout_s: float, device: str) -> RankGroups | None:
    """Join the torch.distributed world of ``topology`` (rank ``rank`` of ``world_size``) through a
    FileStore in ``<run_dir>/rendezvous/<store_name>``, and create its groups (collective; None
    when the world is the train group alone and no reshard groups are needed: ``separate``).
    ``device``: this rank's (see :func:`rank_device`); an accelerator is made current first, as
    nccl/hccl expect."""
    store_path = ctx.run_dir / "rendezvous" / store_name
    store_path.parent.mkdir(parents=True, exist_ok=True)

    def join() -> RankGroups | None:
        kind = torch.device(device).type
        if kind != "cpu":
            getattr(torch, kind).set_device(torch.device(device))
        store: dist.Store
        if ctx.rendezvous_endpoint:  # across hosts: the launcher's store, no shared filesystem needed
            store = connect_store(ctx.rendezvous_endpoint, store_name, timeout_s=timeout_s)
        else:
            store = dist.FileStore(str(store_path), world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        with lock:
            if state["abandoned"]:
                # the stage gave up on this join and has closed already (an in-process run's next
                # run would find a default group initialised): leave no group behind
                dist.destroy_process_group()
                return None
            state["joined"] = True
        return build_rank_groups(topology) if topology is not None else None

    # in a daemon thread: a Stop during set-up (another worker failed, so this rendezvous never
    # completes) abandons the wait instead of holding the process until the store times out
    lock, state = threading.Lock(), {"abandoned": False, "joined": False}
    wait_s = ctx.config.resources.start_timeout_s
    try:
        with anyio.move_on_after(wait_s):
            return await DaemonCall(join, "streamrl-join-world").wait()
    finally:
        with lock:  # once joined, the stage's close() destroys the group; before, the thread does
            state["abandoned"] = not state["joined"]
    raise TimeoutError(f"stage {ctx.spec.name!r} worker {ctx.worker}: joining the torch.distributed world "
                       f"{store_name!r} ({world_size} ranks) took over resources.start_timeout_s={wait_s:g} s; "
                       "a rank did not start (see the other workers' logs)")


def weights_receiver(ctx: StageContext) -> StageSpec:
    """The generate stage this train stage hands its weights to (see ``PipelineSpec.weights_receiver``)."""
    generate = ctx.pipeline.weights_receiver(ctx.spec.name) if ctx.pipeline is not None else None
    if generate is None:
        raise ValueError(f"no stage says `colocate_with: {ctx.spec.name}` or `weights_from: {ctx.spec.name}`; the "
                         f"train stage {ctx.spec.name!r} has no generate stage to hand its weights to")
    return generate
