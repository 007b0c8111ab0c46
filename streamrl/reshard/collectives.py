"""Collective helpers of the reshard (device- and backend-agnostic).

:func:`all_gather_in_place` is the reshard's bucket all-gather. On NCCL/HCCL it is the native
in-place all-gather (the input is this rank's slot of the output, no staging buffer). Gloo's
all-gather stages the whole output in a temporary buffer of the same size (resident memory
grows by twice the gathered bytes), which would double the reshard's peak, so on gloo
the same result is produced by a ring of point-to-point transfers straight into the output
slots: R - 1 steps, each sending the slot received last step to the next rank (through a host
copy when the tensor is on an accelerator: gloo's point-to-point transfers take host memory only).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

# torch >= 2.13 renames *_into_tensor / *_tensor to *_single; same semantics.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def accelerator(device: torch.device) -> Any:
    """torch.cuda / torch.npu for an accelerator device, None on CPU."""
    return getattr(torch, device.type) if device.type != "cpu" else None


def synchronize(device: torch.device) -> None:
    accel = accelerator(device)
    if accel is not None:
        accel.synchronize(device)


def all_gather_in_place(gathered: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Fill every rank's slot of the flat ``gathered`` from the slot its owner filled.

    ``gathered`` holds ``world`` equal slots; this rank has written slot ``rank`` already.
    """
    if group is None:
        return
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n = gathered.numel() // world
    if dist.get_backend(group) != "gloo":
        all_gather_flat(gathered, gathered[rank * n : (rank + 1) * n], group=group)
        return
    if gathered.device.type != "cpu":
        # gloo's point-to-point transfers read and write host memory only (a CUDA pointer fails with
        # "writev ... Bad address"): several ranks on one accelerator ring through a host copy
        host = gathered.cpu()
        all_gather_in_place(host, group)
        gathered.copy_(host)
        return
    nxt = dist.get_global_rank(group, (rank + 1) % world)
    prv = dist.get_global_rank(group, (rank - 1) % world)
    for step in range(world - 1):
        send_slot, recv_slot = (rank - step) % world, (rank - step - 1) % world
        ops = [
            dist.P2POp(dist.isend, gathered[send_slot * n : (send_slot + 1) * n], nxt, group=group),
            dist.P2POp(dist.irecv, gathered[recv_slot * n : (recv_slot + 1) * n], prv, group=group),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
