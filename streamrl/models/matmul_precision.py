"""float32 matmul precision: a run may lower it for the linear layers, never for attention.

``model.matmul_precision`` is torch's ``set_float32_matmul_precision``, applied in every stage
process. ``highest`` (the default) computes float32 matmuls in float32. ``high`` lets them use
TF32 where the hardware has it (NVIDIA Ampere and later); ``medium`` lets them round their
inputs to bfloat16 (AMX or AVX512-BF16 CPUs through oneDNN, and the GPUs), accumulating in
float32 either way. Tensors stay float32: only each product's inputs are rounded, as a TF32
GPU run does.

Attention keeps full precision. On CPUs the lowered precision reaches SDPA's flash kernel
and the decode step's one-query matmuls, whose blocks are too small for the bfloat16 path:
there it is several times slower (SDPA forward and backward 7.5x at W2's shapes), where the
linear layers are 2-4x faster. :func:`ieee_attention` runs an attention call, forward and
backward, at ``highest`` and leaves the rest of the model at the run's precision.

The same holds for a model whose tensors are bfloat16 or float16 (``model.dtype``) on a CPU:
SDPA's half-precision kernels there are slower than its float32 ones at these shapes (W2's train
micro-batch: the backward 11.8 against 8.1 ms a layer) and the decode step's one-query matmuls
convert their operands at every call. So on a CPU a half-precision model's attention computes in
float32 (:func:`attention_dtype`): its inputs are cast up, its output back, and the rollout
engine's KV cache is kept in float32. The linear layers, most of the FLOPs, keep the model's dtype.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from streamrl.config import MatmulPrecision

# The process's precision, as apply() set it: what every block below returns to. Not the
# precision found on entry: torch's setting is one per process, and two threads computing at once
# (colocated stages) would otherwise each restore what the other had set, and could leave the
# process at highest for the rest of the run.
_process_precision: str = "highest"


def apply(precision: MatmulPrecision) -> None:
    """Set this process's float32 matmul precision (a stage process calls it once, at start)."""
    global _process_precision
    _process_precision = precision
    torch.set_float32_matmul_precision(precision)


_inside = threading.local()  # .active: this thread is in an ieee_matmuls block (blocks nest)


@contextlib.contextmanager
def ieee_matmuls() -> Iterator[None]:
    """float32 matmuls at full precision inside the block, the process's precision after it (after
    the outermost block, where blocks nest)."""
    if _process_precision == "highest" or getattr(_inside, "active", False):
        yield
        return
    _inside.active = True
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        _inside.active = False
        torch.set_float32_matmul_precision(_process_precision)


class _RestoreInBackward(torch.autograd.Function):
    """Identity on an attention's inputs: its backward runs right after the attention's, and
    sets back the process's precision."""

    @staticmethod
    def forward(ctx: Any, *tensors: Tensor) -> tuple[Tensor, ...]:
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor, ...]:
        torch.set_float32_matmul_precision(_process_precision)
        return grads


class _IeeeInBackward(torch.autograd.Function):
    """Identity on an attention's output: its backward runs right before the attention's, and
    sets full precision for it."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor) -> Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        torch.set_float32_matmul_precision("highest")
        return grad


_HALF = (torch.bfloat16, torch.float16)


def attention_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a model of ``dtype`` on ``device`` computes its attention in: float32 for a
    half-precision model on a CPU (see the module's docstring), else its own."""
    return torch.float32 if device.type == "cpu" and dtype in _HALF else dtype


def _in_float32(attention: Callable[..., Any], query: Tensor, key: Tensor, value: Tensor,
                *args: Any, **kwargs: Any) -> Any:
    """``attention`` on float32 copies of its half-precision tensors (a float mask too); its output
    (or first output) cast back to the query's dtype. Autograd casts the gradients back likewise."""
    def up(x: Any) -> Any:
        return x.float() if isinstance(x, Tensor) and x.dtype in _HALF else x

    out = attention(up(query), up(key), up(value), *(up(a) for a in args), **{k: up(v) for k, v in kwargs.items()})
    if isinstance(out, tuple):
        return (out[0].to(query.dtype), *out[1:])
    return out.to(query.dtype)


def ieee_attention(attention: Callable[..., Any], query: Tensor, key: Tensor, value: Tensor,
                   *args: Any, **kwargs: Any) -> Any:
    """``attention(query, key, value, *args, **kwargs)`` with its matmuls at full precision, in
    the forward and, where autograd records it, in the backward; the first output (or the output)
    is the attention's result, as transformers' attention functions and SDPA return it.

    Why markers and not a context in the backward: autograd runs the backward later, outside any
    block of the forward. The autograd engine runs a CPU graph's nodes in one thread, latest-made
    first, so the attention's nodes run between the two markers' backwards.

    A half-precision call on a CPU computes in float32 (:func:`attention_dtype`)."""
    if attention_dtype(query.dtype, query.device) != query.dtype:
        return _in_float32(attention, query, key, value, *args, **kwargs)  # float32: no lowered precision here
    if _process_precision == "highest":
        return attention(query, key, value, *args, **kwargs)
    recorded = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    with ieee_matmuls():
        if recorded:
            query, key, value = _RestoreInBackward.apply(query, key, value)
        out = attention(query, key, value, *args, **kwargs)
    if not recorded:
        return out
    if isinstance(out, tuple):
        return (_IeeeInBackward.apply(out[0]), *out[1:])
    return _IeeeInBackward.apply(out)
