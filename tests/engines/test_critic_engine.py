"""The critic's engine at R=1 in the pytest process: its values sit at the positions that predict
each response token, and its steps fit a fixed batch (the clipped value loss goes down)."""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from streamrl.engines.critic import FSDPCriticEngine
from streamrl.engines.samples import TrainBatchError
from streamrl.models.build import build_model
from streamrl.models.value import CausalLMValueModel
from tests.engines.conftest import TINY, encode

pytestmark = pytest.mark.usefixtures("world_of_one")


def _batch(tok: PreTrainedTokenizerFast) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    prompts = encode(tok, ["1+2=", "1+2=", "13+4=", "7="])
    responses = encode(tok, ["3", "45", "17", "777"])
    # returns to fit: a constant per sample; the first two share their first state (prompt "1+2="),
    # so they share a target there too, or no critic could fit both
    returns = [torch.full((r.numel(),), target) for r, target in zip(responses, (1.0, 1.0, 0.5, -0.5), strict=True)]
    return prompts, responses, returns


def test_values_are_the_value_heads_output_at_the_predicting_positions(tok: PreTrainedTokenizerFast) -> None:
    model = CausalLMValueModel(build_model(TINY, tok), seed=1)
    # an unsharded reference copy, one sequence at a time: prompt + response, value at P - 1 + t
    reference = CausalLMValueModel(build_model(TINY, tok), seed=1).eval()
    engine = FSDPCriticEngine(model, lr=1e-3, device="cpu")
    prompts, responses, _ = _batch(tok)
    values = engine.values(prompts, responses)
    for p, r, v in zip(prompts, responses, values, strict=True):
        with torch.no_grad():
            full = reference(torch.cat([p, r]).unsqueeze(0))[0]
        torch.testing.assert_close(v, full[p.numel() - 1:p.numel() - 1 + r.numel()], atol=1e-5, rtol=1e-5)
    # the head starts small: the first values are about 0
    assert max(float(v.abs().max()) for v in values) < 0.1


def test_the_value_loss_decreases_on_a_fixed_batch(tok: PreTrainedTokenizerFast) -> None:
    engine = FSDPCriticEngine(CausalLMValueModel(build_model(TINY, tok)), lr=3e-3, device="cpu")
    prompts, responses, returns = _batch(tok)
    losses = []
    for _ in range(25):
        old = engine.values(prompts, responses)
        engine.accumulate_values(prompts, responses, old, returns, value_clip=0.2)
        stats = engine.step()
        losses.append(stats["loss"])
        assert stats["tokens"] == sum(r.numel() for r in responses) and stats["sequences"] == 4
    assert losses[-1] < 0.2 * losses[0], losses
    assert engine.steps == 25


def test_a_loss_mask_drops_tokens_and_bad_shapes_are_refused(tok: PreTrainedTokenizerFast) -> None:
    engine = FSDPCriticEngine(CausalLMValueModel(build_model(TINY, tok)), lr=1e-3, device="cpu")
    prompts, responses, returns = _batch(tok)
    old = engine.values(prompts, responses)
    masks = [torch.ones(r.numel(), dtype=torch.int64) for r in responses]
    masks[3][1:] = 0  # "777": only its first token is trained
    stats = engine.accumulate_values(prompts, responses, old, returns, value_clip=None, loss_mask=masks)
    assert stats["tokens"] == sum(r.numel() for r in responses) - 2
    engine.zero_grad()
    with pytest.raises(TrainBatchError, match="sample 1: returns must be a 1-D tensor with one value per response"):
        engine.accumulate_values(prompts, responses, old, [returns[0]] * 4, value_clip=0.2)
