"""Swap the training state (parameters, gradients, optimizer moments) between device and host.

Colocated ranks alternate generation and training on one device; while generation runs, the
training state lives in host memory so the device holds only what the current phase needs.

The Parameter objects and the optimizer's state dict stay the same Python objects (the
optimizer keeps its references); only the storage they point at moves: ``param.data``,
``param.grad`` and each tensor in ``optimizer.state[param]`` are rebound to a host buffer on
the way out and to a fresh device tensor on the way in. Host buffers are allocated once and
reused (page-locked on CUDA/NPU, so the copies are asynchronous and run at full bus speed);
copies are issued ``non_blocking`` and synchronised once per direction. On CPU the same code
runs with the host store standing in for the device (a copy into separate buffers), which is
what the tests exercise.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from streamrl.reshard.accounting import SwapReport
from streamrl.reshard.collectives import synchronize


class SwapStateError(RuntimeError):
    """A swap in the wrong direction (out while already out, in while already in)."""


class TrainStateSwap:
    def __init__(
        self, params: Sequence[torch.nn.Parameter], optimizer: torch.optim.Optimizer, device: torch.device
    ):
        self.params = list(params)
        self.optimizer = optimizer
        self.device = torch.device(device)
        self.pinned = self.device.type in ("cuda", "npu")
        self._host: dict[tuple[int, str], torch.Tensor] = {}
        self._moved: list[tuple[int, str]] = []  # slots that are on the host now
        self.on_host = False

    def _slots(self) -> list[tuple[tuple[int, str], torch.Tensor]]:
        """(key, tensor) of every state tensor: param data, grad, optimizer state tensors."""
        slots: list[tuple[tuple[int, str], torch.Tensor]] = []
        for i, p in enumerate(self.params):
            slots.append(((i, "data"), p.data))
            if p.grad is not None:
                slots.append(((i, "grad"), p.grad))
            for key, value in self.optimizer.state.get(p, {}).items():
                # AdamW keeps `step` as a CPU scalar tensor unless capturable; scalars stay put
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    slots.append(((i, f"state.{key}"), value))
        return slots

    def _current(self, key: tuple[int, str]) -> torch.Tensor:
        index, what = key
        p = self.params[index]
        if what == "data":
            return p.data
        if what == "grad":
            assert p.grad is not None
            return p.grad
        return self.optimizer.state[p][what.removeprefix("state.")]

    def _rebind(self, key: tuple[int, str], tensor: torch.Tensor) -> None:
        index, what = key
        p = self.params[index]
        if what == "data":
            p.data = tensor
        elif what == "grad":
            p.grad = tensor
        else:
            self.optimizer.state[p][what.removeprefix("state.")] = tensor

    def _host_buffer(self, key: tuple[int, str], like: torch.Tensor) -> torch.Tensor:
        buffer = self._host.get(key)
        if buffer is None or buffer.shape != like.shape or buffer.dtype != like.dtype:
            buffer = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=self.pinned)
            self._host[key] = buffer
        return buffer

    def to_host(self) -> SwapReport:
        if self.on_host:
            raise SwapStateError("training state is already on the host; call to_device() first")
        t0 = time.perf_counter()
        slots = self._slots()
        moved = []
        for key, tensor in slots:
            host = self._host_buffer(key, tensor)
            host.copy_(tensor, non_blocking=True)
            moved.append((key, host))
        synchronize(self.device)  # the host copies must land before the device storage is dropped
        for key, host in moved:
            self._rebind(key, host)  # drops the last reference to the device tensor
        self._moved = [key for key, _ in moved]
        self.on_host = True
        nbytes = sum(t.numel() * t.element_size() for _, t in slots)
        return SwapReport("to_host", len(slots), nbytes, time.perf_counter() - t0, self.pinned)

    def to_device(self) -> SwapReport:
        if not self.on_host:
            raise SwapStateError("training state is already on the device; call to_host() first")
        t0 = time.perf_counter()
        slots = [(key, self._current(key)) for key in self._moved]
        for key, host in slots:
            device_tensor = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            device_tensor.copy_(host, non_blocking=True)
            self._rebind(key, device_tensor)
        synchronize(self.device)
        self._moved = []
        self.on_host = False
        nbytes = sum(t.numel() * t.element_size() for _, t in slots)
        return SwapReport("to_device", len(slots), nbytes, time.perf_counter() - t0, self.pinned)
