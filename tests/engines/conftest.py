"""Tiny models for the engine tests (fast on 2 cores)."""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from streamrl.models.build import TinyModelSpec, build_model
from streamrl.models.tokenizer import build_char_tokenizer

TINY = TinyModelSpec(hidden=32, layers=2, heads=4, intermediate=64, seed=3)


@pytest.fixture(scope="session")
def tok() -> PreTrainedTokenizerFast:
    return build_char_tokenizer()


@pytest.fixture
def model(tok: PreTrainedTokenizerFast) -> torch.nn.Module:
    return build_model(TINY, tok)


def encode(tok: PreTrainedTokenizerFast, texts: list[str]) -> list[torch.Tensor]:
    return [torch.tensor(tok(t)["input_ids"], dtype=torch.int64) for t in texts]


def constant_model(tok: PreTrainedTokenizerFast, eos_logit: float) -> torch.nn.Module:
    """A model whose next-token logits are the same everywhere: EOS gets ``eos_logit``, others 0.

    Attention and MLP outputs are zeroed and every embedding is the same positive vector, so the
    final hidden state is a constant positive vector h; lm_head row EOS = eos_logit * h / |h|^2.
    """
    model = build_model(TINY, tok)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        hidden = model.model.norm(torch.ones(1, TINY.hidden))[0]
        model.lm_head.weight[tok.eos_token_id] = eos_logit * hidden / hidden.dot(hidden)
    return model
