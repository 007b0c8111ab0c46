"""Torch's fused RMSNorm kernel in place of a Hugging Face RMSNorm module's decomposed forward.

Why: transformers' RMSNorm (Llama, Qwen2, Mistral, ...) is written as six tensor ops (a float32
cast, ``pow``, ``mean``, ``rsqrt`` of the sum, two products), each one pass over the activations,
and autograd saves and replays as many for the backward. ``torch.nn.functional.rms_norm`` computes
the same in one kernel each way. In a training step of small models the activations' elementwise
passes are memory-bound, so the norms of every layer add up (W2's train micro-batch: 3-5 % of its
time, docs/benchmarks.md).

Which modules: not by class name, by what they compute. :func:`fuse_rms_norms` probes every
module named ``*RMSNorm`` that has a 1-D ``weight`` and an epsilon: its output on a random input
must equal ``F.rms_norm``'s, else the module keeps its forward (Gemma's ``1 + weight`` scaling,
for example, differs and stays). The fused forward serves float32 inputs and plain tensors; a
bfloat16 input (whose rounding differs between the two: HF casts before the weight product) or a
DTensor (tensor parallelism) takes the module's own forward.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import Tensor, nn

PROBE_ATOL = 1e-6  # float32: the two forwards differ only in summation order


def _epsilon(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def _fused_forward(self: nn.Module, hidden_states: Tensor) -> Tensor:
    weight = self.weight
    if hidden_states.dtype != torch.float32 or weight.dtype != torch.float32 or not (
        type(hidden_states) in (Tensor, nn.Parameter) and type(weight) in (Tensor, nn.Parameter)
    ):
        return type(self).forward(self, hidden_states)
    return F.rms_norm(hidden_states, (hidden_states.shape[-1],), weight, self._fused_eps)


@torch.no_grad()
def _computes_rms_norm(module: nn.Module, weight: Tensor, eps: float) -> bool:
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(3, weight.numel(), generator=generator) * 3.0).to(weight.device)
    try:
        expected = module(x)
    except Exception:  # a module that cannot take a plain [3, n] input is not probed further
        return False
    if not isinstance(expected, Tensor) or expected.shape != x.shape:
        return False
    return torch.allclose(expected, F.rms_norm(x, (x.shape[-1],), weight.detach(), eps), rtol=1e-5, atol=PROBE_ATOL)


def fuse_rms_norms(model: nn.Module) -> int:
    """Give each RMSNorm of ``model`` whose output is ``F.rms_norm``'s the fused forward; returns how
    many. Idempotent; parameters, state dicts and hooks are untouched (only ``forward`` is bound on
    the instance)."""
    fused = 0
    for module in model.modules():
        if "forward" in vars(module):  # already fused (or a forward someone else bound)
            fused += isinstance(getattr(module, "_fused_eps", None), float)
            continue
        weight = getattr(module, "weight", None)
        eps = _epsilon(module)
        if (
            not type(module).__name__.endswith("RMSNorm") or eps is None or not isinstance(weight, Tensor)
            or weight.dim() != 1 or weight.dtype != torch.float32
        ):
            continue
        if _computes_rms_norm(module, weight, eps):
            module._fused_eps = eps  # type: ignore[assignment]
            module.forward = types.MethodType(_fused_forward, module)  # type: ignore[method-assign]
            fused += 1
    return fused
