"""Tiny models for the engine tests (fast on 2 cores), and a gloo world of one in the pytest process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
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


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """torch.distributed initialised in this process as a gloo world of 1 (what FSDPTrainEngine
    needs at R=1), for one test module; destroyed at the module's end whatever its tests did, so
    no other module of the session finds a default process group."""
    if dist.is_initialized():
        raise RuntimeError("a default process group is already initialised in this pytest process; "
                           "another fixture or test leaked one")
    store = dist.FileStore(str(tmp_path_factory.mktemp("gloo") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()


def encode(tok: PreTrainedTokenizerFast, texts: list[str]) -> list[torch.Tensor]:
    return [torch.tensor(tok(t)["input_ids"], dtype=torch.int64) for t in texts]


def constant_model(tok: PreTrainedTokenizerFast, eos_logit: float, spec: TinyModelSpec = TINY) -> torch.nn.Module:
    """A model whose next-token logits are the same everywhere: EOS gets ``eos_logit``, others 0.

    Attention and MLP outputs are zeroed and every embedding is the same positive vector, so the
    final hidden state is a constant positive vector h; lm_head row EOS = eos_logit * h / |h|^2.
    """
    model = build_model(spec, tok)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        hidden = model.model.norm(torch.ones(1, spec.hidden))[0]
        model.lm_head.weight[tok.eos_token_id] = eos_logit * hidden / hidden.dot(hidden)
    return model
