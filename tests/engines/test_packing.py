"""Shared-prompt packing (streamrl/engines/packing.py) computes what the padded rows compute.

Every comparison is float32 on CPU and also checked against the ground truth, the plain Hugging
Face forward of each prompt+response alone. No process group: the packing runs on a plain module.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast, Qwen2ForCausalLM

from streamrl.engines.logprob import LogprobEngine
from streamrl.engines.packing import (
    ForwardPath,
    ModelInputs,
    attention_mask_dtype,
    model_inputs,
    packed_inputs,
    padded_inputs,
    probe_packing,
    probe_shared_prefix,
    response_logits,
    uses_logits_to_keep,
)
from streamrl.engines.samples import TrainBatchError
from streamrl.models.build import TinyModelSpec, build_model
from tests.engines.conftest import TINY, encode

ATOL = 1e-5
CPU = torch.device("cpu")


def _batch(tok: PreTrainedTokenizerFast) -> tuple[list[Tensor], list[Tensor]]:
    """Three prompts of lengths 6, 2 and 8, their samples interleaved (grouping is by content, not
    order); groups of 4, 3 and 1 completions; responses of 1 token (one of them the only completion
    of its prompt) and one empty response."""
    g = torch.Generator().manual_seed(7)
    texts = ["12+34=", "7=", "12+34=", "123*456=", "7=", "12+34=", "12+34=", "7=", "12+34="]
    lengths = [5, 1, 1, 1, 4, 3, 7, 2, 0]
    prompts = encode(tok, texts)
    responses = [torch.randint(3, len(tok), (n,), generator=g) for n in lengths]
    return prompts, responses


def _logprobs(model: torch.nn.Module, path: ForwardPath, prompts: list[Tensor], responses: list[Tensor], *,
              max_row_tokens: int = 4096, keep_from_first: bool | None = None, shared_prefix: bool = False) -> Tensor:
    """Flat response-token logprobs [N] through ``path``'s layout (with gradient if enabled);
    ``shared_prefix``: with the packed rows' layout for the shared-prefix attention."""
    keep = uses_logits_to_keep(model) if keep_from_first is None else keep_from_first
    inputs = model_inputs(path, prompts, responses, CPU, mask_dtype=attention_mask_dtype(model),
                          max_row_tokens=max_row_tokens, keep_from_first=keep, shared_prefix=shared_prefix)
    logits = response_logits(model, inputs)
    targets = torch.cat(responses)
    return torch.log_softmax(logits.float(), -1).gather(1, targets.unsqueeze(1)).squeeze(1)


def _alone(model: torch.nn.Module, prompts: list[Tensor], responses: list[Tensor]) -> Tensor:
    """The ground truth: each prompt+response through the plain forward on its own."""
    out = []
    with torch.no_grad():
        for p, r in zip(prompts, responses, strict=True):
            logits = model(torch.cat([p, r]).unsqueeze(0)).logits[0, p.numel() - 1 : -1]
            out.append(torch.log_softmax(logits, -1).gather(1, r.unsqueeze(1)).squeeze(1))
    return torch.cat(out)


def _eager_copy(model: PreTrainedModel) -> PreTrainedModel:
    """The same weights with ``attn_implementation="eager"`` in the config."""
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(model.config), attn_implementation="eager")
    eager.load_state_dict(model.state_dict())
    return eager.eval()


def test_packed_equals_padded(model: PreTrainedModel, tok: PreTrainedTokenizerFast) -> None:
    prompts, responses = _batch(tok)
    model.eval()
    packed = packed_inputs(prompts, responses, CPU, mask_dtype=None)
    padded = padded_inputs(prompts, responses, CPU)
    # one row per distinct prompt, each prompt once: far fewer positions than the padded rows
    assert packed.kwargs["input_ids"].shape == (3, 6 + 4 + 0 + 2 + 6 + 0)
    assert padded.kwargs["input_ids"].shape == (9, 6 + 6)
    assert packed.kwargs["attention_mask"].shape == (3, 1, 18, 18)
    assert packed.kwargs["attention_mask"].dtype == torch.bool
    row = packed.kwargs["input_ids"][0]
    assert torch.equal(row[:6], prompts[0]) and torch.equal(row[6:10], responses[0][:-1])
    assert packed.kwargs["position_ids"][0, :10].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert packed.kwargs["position_ids"][0, 10:12].tolist() == [6, 7]  # restarts after the prompt
    truth = _alone(model, prompts, responses)
    assert truth.numel() == sum(r.numel() for r in responses) == 24
    with torch.no_grad():
        for keep in (True, False):
            got = {path: _logprobs(model, path, prompts, responses, keep_from_first=keep)
                   for path in ("packed", "padded")}
            torch.testing.assert_close(got["packed"], got["padded"], atol=ATOL, rtol=0)
            torch.testing.assert_close(got["packed"], truth, atol=ATOL, rtol=0)


@pytest.mark.parametrize("max_row_tokens", [2, 9, 12])
def test_a_group_split_over_rows_gives_the_same(
    model: PreTrainedModel, tok: PreTrainedTokenizerFast, max_row_tokens: int
) -> None:
    prompts, responses = _batch(tok)
    model.eval()
    inputs = packed_inputs(prompts, responses, CPU, mask_dtype=None, max_row_tokens=max_row_tokens)
    whole = packed_inputs(prompts, responses, CPU, mask_dtype=None)
    rows = inputs.kwargs["input_ids"].shape[0]
    assert rows > whole.kwargs["input_ids"].shape[0]  # the 4-completion group no longer fits in one row
    for r in range(rows):
        n = int(inputs.kwargs["attention_mask"][r, 0, :, 0].sum())  # every non-padding query sees token 0
        positions = inputs.kwargs["position_ids"][r, :n]
        completions_restarting = int((positions[1:] <= positions[:-1]).sum())
        # a row outgrows the limit only when it holds a single (non-empty) completion
        assert n <= max_row_tokens or completions_restarting == 0, (r, n, positions.tolist())
    with torch.no_grad():
        split = _logprobs(model, "packed", prompts, responses, max_row_tokens=max_row_tokens)
        padded = _logprobs(model, "padded", prompts, responses)
    torch.testing.assert_close(split, padded, atol=ATOL, rtol=0)
    torch.testing.assert_close(split, _alone(model, prompts, responses), atol=ATOL, rtol=0)


def test_eager_attention_gives_the_same_as_sdpa(model: PreTrainedModel, tok: PreTrainedTokenizerFast) -> None:
    prompts, responses = _batch(tok)
    model.eval()
    eager = _eager_copy(model)
    assert model.config._attn_implementation == "sdpa" and eager.config._attn_implementation == "eager"
    assert attention_mask_dtype(model) is None and attention_mask_dtype(eager) == torch.float32
    mask = packed_inputs(prompts, responses, CPU, mask_dtype=torch.float32).kwargs["attention_mask"]
    allowed = packed_inputs(prompts, responses, CPU, mask_dtype=None).kwargs["attention_mask"]
    assert mask.dtype == torch.float32  # additive: 0 where allowed, the dtype's minimum elsewhere
    assert torch.equal(mask == 0, allowed) and bool((mask[~allowed] == torch.finfo(torch.float32).min).all())
    with torch.no_grad():
        sdpa = _logprobs(model, "packed", prompts, responses)
        for path in ("packed", "padded"):
            torch.testing.assert_close(_logprobs(eager, path, prompts, responses), sdpa, atol=ATOL, rtol=0)
        torch.testing.assert_close(_logprobs(eager, "packed", prompts, responses, max_row_tokens=9), sdpa,
                                   atol=ATOL, rtol=0)
    assert probe_packing(eager, CPU)[0] == "packed"


@pytest.mark.parametrize("max_row_tokens", [4096, 9])
def test_gradients_through_the_packed_forward_equal_the_padded(
    model: PreTrainedModel, tok: PreTrainedTokenizerFast, max_row_tokens: int
) -> None:
    prompts, responses = _batch(tok)
    assert_same_gradients(
        model, responses,
        lambda m: _logprobs(m, "packed", prompts, responses, max_row_tokens=max_row_tokens),
        lambda m: _logprobs(m, "padded", prompts, responses),
    )


def assert_same_gradients(model: torch.nn.Module, responses: list[Tensor],
                          got: Callable[[torch.nn.Module], Tensor], want: Callable[[torch.nn.Module], Tensor]) -> None:
    """The parameter gradients of a weighted sum of response logprobs, computed two ways on copies of ``model``."""
    weights = torch.linspace(-1.0, 2.0, sum(r.numel() for r in responses))  # every token counts differently
    grads = []
    for logprobs in (got, want):
        m = copy.deepcopy(model).train()
        (logprobs(m) * weights).sum().backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
    assert all(g is not None for g in grads[0].values())
    for name, g in grads[1].items():
        torch.testing.assert_close(grads[0][name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_probe_packing_chooses_packed_where_the_model_honours_the_mask(
    model: PreTrainedModel, tok: PreTrainedTokenizerFast
) -> None:
    path, why = probe_packing(model, CPU)
    assert path == "packed" and "Qwen2ForCausalLM" in why
    gpt2 = build_model(TinyModelSpec(arch="gpt2", hidden=32, layers=2, heads=4, intermediate=64, seed=3), tok)
    path, why = probe_packing(gpt2, CPU)
    assert path == "packed" and "GPT2LMHeadModel" in why
    assert gpt2.training  # the probe puts the module back in the mode it found
    prompts, responses = _batch(tok)
    gpt2.eval()
    with torch.no_grad():  # learned positions: position_ids restarting after the prompt are honoured
        torch.testing.assert_close(_logprobs(gpt2, "packed", prompts, responses),
                                   _alone(gpt2, prompts, responses), atol=ATOL, rtol=0)


class _DropsPackingInputs(Qwen2ForCausalLM):
    """A causal LM whose forward ignores the attention mask and position ids it is given."""

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,  # type: ignore[override]
                position_ids: Tensor | None = None, **kwargs: object) -> object:
        return super().forward(input_ids=input_ids, **kwargs)


class _RefusesPackingInputs(Qwen2ForCausalLM):
    """A causal LM whose forward refuses a 4-D attention mask."""

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,  # type: ignore[override]
                **kwargs: object) -> object:
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError("only a 2-D padding mask is supported")
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)


def test_probe_packing_falls_back_to_padded(model: PreTrainedModel, tok: PreTrainedTokenizerFast) -> None:
    for cls, reason in ((_DropsPackingInputs, "does not honour a 4-D attention mask"),
                        (_RefusesPackingInputs, "packing failed on _RefusesPackingInputs (ValueError: only a 2-D")):
        other = cls(model.config)
        other.load_state_dict(model.state_dict())
        path, why = probe_packing(other, CPU)
        assert path == "padded", cls
        assert reason in why, why
        assert LogprobEngine(other, device="cpu").forward_path == "padded"


def test_a_lowered_matmul_precision_keeps_the_packed_forward(model: PreTrainedModel, medium_matmuls: None) -> None:
    """The probes compare packed and padded rows at full precision: under model.matmul_precision
    medium the two differ by bfloat16 rounding (the rows' layout changes the products), which is
    not a model that ignores the mask."""
    path, why = probe_packing(model, CPU)
    assert path == "packed", why
    on, why = probe_shared_prefix(copy.deepcopy(model), CPU)
    assert on, why
    assert torch.get_float32_matmul_precision() == "medium"


def test_logprob_engine_equals_the_padded_forward(model: PreTrainedModel, tok: PreTrainedTokenizerFast) -> None:
    prompts, responses = _batch(tok)
    frozen = copy.deepcopy(model).requires_grad_(False)
    engine = LogprobEngine(frozen, device="cpu")
    assert engine.forward_path == "packed"
    assert LogprobEngine(copy.deepcopy(frozen), device="cpu", pack_prompts=False).forward_path == "padded"
    got = engine.logprobs(prompts, responses)
    assert [g.numel() for g in got] == [r.numel() for r in responses]
    assert all(g.dtype == torch.float32 and g.device.type == "cpu" for g in got)
    model.eval()
    with torch.no_grad():
        padded = _logprobs(model, "padded", prompts, responses)
        torch.testing.assert_close(torch.cat(got), padded, atol=ATOL, rtol=0)
        torch.testing.assert_close(torch.cat(got), _alone(model, prompts, responses), atol=ATOL, rtol=0)
        # temperature divides the logits before the softmax
        hot = torch.cat(engine.logprobs(prompts, responses, temperature=2.0))
        inputs: ModelInputs = padded_inputs(prompts, responses, CPU)
        logits = response_logits(model, inputs) / 2.0
        expected = torch.log_softmax(logits, -1).gather(1, torch.cat(responses).unsqueeze(1)).squeeze(1)
        torch.testing.assert_close(hot, expected, atol=ATOL, rtol=0)
    assert engine.logprobs([], []) == []
    with pytest.raises(TrainBatchError, match="sample 1: response_ids must be a 1-D int64"):
        engine.logprobs(prompts[:2], [responses[0], responses[1].float()])
    with pytest.raises(TrainBatchError, match="2 prompts but 1 responses"):
        engine.logprobs(prompts[:2], responses[:1])
    # new weights replace the old ones (strict)
    other = build_model(TinyModelSpec(hidden=TINY.hidden, layers=TINY.layers, heads=TINY.heads,
                                      intermediate=TINY.intermediate, seed=TINY.seed + 1), tok)
    engine.load_state_dict(other.state_dict())
    torch.testing.assert_close(torch.cat(engine.logprobs(prompts, responses)), _alone(other.eval(), prompts, responses),
                               atol=ATOL, rtol=0)
    with pytest.raises(RuntimeError, match="Missing key"):
        engine.load_state_dict({})
