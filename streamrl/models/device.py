"""Pick a device: what the pipeline checks (in the launcher, before anything starts) and the
workers ask of a ``device`` setting, without the model code of :mod:`streamrl.models.build`."""

from __future__ import annotations

import importlib

import torch


class DeviceUnavailableError(RuntimeError):
    """The requested device does not exist on this machine."""


def _npu_available() -> bool:
    try:
        importlib.import_module("torch_npu")  # registers torch.npu
    except ImportError:
        return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """Turn "auto" | "cpu" | "cuda" | "cuda:N" | "npu" | "npu:N" into an available torch.device.

    "auto" picks CUDA, then Ascend NPU (when torch_npu imports), then CPU.
    """
    if isinstance(device, torch.device):
        device = str(device)
    name = device.strip().lower()
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if _npu_available():
            return torch.device("npu")
        return torch.device("cpu")
    kind, _, index_text = name.partition(":")
    if index_text and not index_text.isdigit():
        raise DeviceUnavailableError(f"device {device!r}: index after ':' must be a number, e.g. 'cuda:1'")
    index = int(index_text) if index_text else None
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailableError(
                f"device {device!r} requested but CUDA is not available (torch {torch.__version__}); "
                "use 'cpu' or 'auto'"
            )
        count = torch.cuda.device_count()
    elif kind == "npu":
        if not _npu_available():
            raise DeviceUnavailableError(
                f"device {device!r} requested but no Ascend NPU is usable (install torch_npu on an NPU host); "
                "use 'cpu' or 'auto'"
            )
        count = torch.npu.device_count()  # type: ignore[attr-defined]
    else:
        raise DeviceUnavailableError(f"unknown device {device!r}; use 'auto', 'cpu', 'cuda', 'cuda:N' or 'npu'")
    if index is not None and index >= count:
        raise DeviceUnavailableError(f"device {device!r} requested but only {count} {kind} device(s) exist")
    return torch.device(kind, index) if index is not None else torch.device(kind)
