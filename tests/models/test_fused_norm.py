"""RMSNorm modules on torch's fused kernel: chosen by what they compute, same outputs and gradients."""

from __future__ import annotations

import copy

import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

from streamrl.models.build import TinyModelSpec, build_model
from streamrl.models.fused_norm import fuse_rms_norms
from streamrl.models.tokenizer import build_char_tokenizer

SPEC = TinyModelSpec(hidden=32, layers=2, heads=4, intermediate=64, seed=1)


def _model() -> torch.nn.Module:
    model = build_model(SPEC, build_char_tokenizer())
    with torch.no_grad():  # norms at 1.0 would hide a weight the fused forward did not apply
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def test_fused_model_gives_the_same_logits_and_gradients() -> None:
    plain = _model()
    fused = copy.deepcopy(plain)
    assert fuse_rms_norms(fused) == 2 * SPEC.layers + 1  # input + post-attention per layer, final
    assert fuse_rms_norms(fused) == 2 * SPEC.layers + 1  # idempotent
    ids = torch.randint(0, 15, (3, 9), generator=torch.Generator().manual_seed(0))
    out_plain, out_fused = plain(ids).logits, fused(ids).logits
    torch.testing.assert_close(out_fused, out_plain, atol=1e-5, rtol=1e-5)
    out_plain.square().mean().backward()
    out_fused.square().mean().backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), fused.named_parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4, msg=name)
    assert fused.state_dict().keys() == plain.state_dict().keys()


def test_a_norm_that_computes_something_else_keeps_its_forward() -> None:
    gemma = torch.nn.Sequential(GemmaRMSNorm(16, eps=1e-6))  # scales by 1 + weight
    assert fuse_rms_norms(gemma) == 0
    assert "forward" not in vars(gemma[0])


def test_bfloat16_inputs_take_the_modules_own_forward() -> None:
    model = _model()
    fuse_rms_norms(model)
    norm = model.model.norm
    x = torch.randn(4, SPEC.hidden).to(torch.bfloat16)
    assert torch.equal(norm(x), type(norm).forward(norm, x))  # bit for bit: the same code ran
