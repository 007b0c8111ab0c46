"""A lowered float32 matmul precision reaches the linear layers, never attention, forward and backward."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from streamrl.models.matmul_precision import apply, attention_dtype, ieee_attention, ieee_matmuls


class _Spy(torch.autograd.Function):
    """Identity that records the float32 matmul precision its forward and its backward ran at."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, seen: list[str], tag: str) -> Tensor:
        ctx.seen, ctx.tag = seen, tag
        seen.append(f"{tag} forward {torch.get_float32_matmul_precision()}")
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        ctx.seen.append(f"{ctx.tag} backward {torch.get_float32_matmul_precision()}")
        return grad, None, None


def _qkv(seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 4, 6, 8, generator=g, requires_grad=True) for _ in range(3))  # type: ignore[return-value]


def _grads(attention_call: Any) -> tuple[Tensor, list[Tensor]]:
    q, k, v = _qkv()
    out = attention_call(q, k, v)
    out = out[0] if isinstance(out, tuple) else out
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), [t.grad for t in (q, k, v)]  # type: ignore[misc]


@pytest.mark.parametrize("as_tuple", [False, True], ids=["tensor", "transformers-tuple"])
def test_attention_runs_at_full_precision_forward_and_backward(medium_matmuls: None, as_tuple: bool) -> None:
    seen: list[str] = []

    def attention(q: Tensor, k: Tensor, v: Tensor) -> Any:
        out = F.scaled_dot_product_attention(_Spy.apply(q, seen, "attention"), k, v, is_causal=True)
        return (out, None) if as_tuple else out

    out, grads = _grads(lambda q, k, v: ieee_attention(attention, q, k, v))
    assert seen == ["attention forward highest", "attention backward highest"]
    assert torch.get_float32_matmul_precision() == "medium"  # the run's, once the backward is through
    apply("highest")
    want_out, want_grads = _grads(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert torch.equal(out, want_out)  # the same kernels at the same precision: bit for bit
    for got, want in zip(grads, want_grads, strict=True):
        assert torch.equal(got, want)


def test_the_layers_around_attention_keep_the_runs_precision(medium_matmuls: None) -> None:
    seen: list[str] = []
    x = torch.randn(6, 8, requires_grad=True)
    w_in, w_out = torch.randn(24, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    qkv = F.linear(_Spy.apply(x, seen, "in"), w_in).view(1, 6, 3, 8).permute(2, 0, 1, 3)
    out = ieee_attention(lambda q, k, v: F.scaled_dot_product_attention(_Spy.apply(q, seen, "attention"), k, v),
                         qkv[0], qkv[1], qkv[2])
    F.linear(_Spy.apply(out.reshape(6, 8), seen, "out"), w_out).sum().backward()
    assert seen == ["in forward medium", "attention forward highest", "out forward medium",
                    "out backward medium", "attention backward highest", "in backward medium"]
    assert torch.get_float32_matmul_precision() == "medium"


def test_at_highest_the_attention_is_called_as_it_is() -> None:
    q, k, v = _qkv()
    out = ieee_attention(F.scaled_dot_product_attention, q, k, v)
    assert "ScaledDotProduct" in type(out.grad_fn).__name__  # no marker around it


def test_without_autograd_only_the_forward_is_switched(medium_matmuls: None) -> None:
    seen: list[str] = []
    with torch.no_grad():
        ieee_attention(lambda q, k, v: F.scaled_dot_product_attention(_Spy.apply(q, seen, "attention"), k, v),
                       *_qkv())
    assert seen == ["attention forward highest"]
    assert torch.get_float32_matmul_precision() == "medium"


def test_ieee_matmuls_sets_back_the_precision_after_an_error(medium_matmuls: None) -> None:
    with pytest.raises(RuntimeError, match="inside"), ieee_matmuls():
        assert torch.get_float32_matmul_precision() == "highest"
        raise RuntimeError("inside")
    assert torch.get_float32_matmul_precision() == "medium"


def test_a_nested_block_leaves_the_outer_one_at_full_precision(medium_matmuls: None) -> None:
    with ieee_matmuls():
        with ieee_matmuls():
            pass
        assert torch.get_float32_matmul_precision() == "highest"
    assert torch.get_float32_matmul_precision() == "medium"


def test_a_block_sets_back_the_processs_precision_not_the_one_it_found(medium_matmuls: None) -> None:
    """torch's setting is one per process: a block that found another thread's highest must not keep it."""
    torch.set_float32_matmul_precision("highest")  # as another thread's open block would have it
    with ieee_matmuls():
        pass
    assert torch.get_float32_matmul_precision() == "medium"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("as_tuple", [False, True], ids=["tensor", "transformers-tuple"])
def test_a_half_precision_attention_on_a_cpu_computes_in_float32(dtype: torch.dtype, as_tuple: bool) -> None:
    """model.dtype bfloat16/float16 on a CPU: SDPA sees float32 inputs (a float mask too), the output and the
    gradients come back in the model's dtype, and equal SDPA's float32 result rounded to it."""
    seen: list[torch.dtype] = []

    def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Any:
        seen.extend([q.dtype, k.dtype, v.dtype, mask.dtype])
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return (out, None) if as_tuple else out

    mask = torch.zeros(6, 6).masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=g).to(dtype).requires_grad_() for _ in range(3))
    out = ieee_attention(attention, q, k, v, mask.to(dtype))
    out = out[0] if as_tuple else out
    assert seen == [torch.float32] * 4
    assert out.dtype == dtype
    want = F.scaled_dot_product_attention(q.detach().float(), k.detach().float(), v.detach().float(), attn_mask=mask)
    assert torch.equal(out.detach(), want.to(dtype))
    out.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == dtype for t in (q, k, v))


def test_attention_dtype() -> None:
    cpu = torch.device("cpu")
    assert attention_dtype(torch.bfloat16, cpu) == attention_dtype(torch.float16, cpu) == torch.float32
    assert attention_dtype(torch.float32, cpu) == torch.float32
    assert attention_dtype(torch.bfloat16, torch.device("cuda")) == torch.bfloat16  # the device's own kernels
