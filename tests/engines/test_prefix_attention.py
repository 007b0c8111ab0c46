"""The shared-prefix attention (streamrl/engines/prefix_attention.py) computes what the dense mask does.

Float32 on CPU, against the padded rows and against the ground truth (each prompt+response alone
through the plain forward); gradients too. No process group: the attention runs on a plain module.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerFast, Qwen2ForCausalLM

from streamrl.engines import prefix_attention
from streamrl.engines.logprob import LogprobEngine
from streamrl.engines.packing import (
    DEFAULT_SHARED_PREFIX_MIN_PADDING,
    DEFAULT_SHARED_PREFIX_MIN_WIDTH,
    ResponseForward,
    packed_inputs,
    probe_shared_prefix,
    response_logits,
)
from streamrl.models.build import TinyModelSpec, build_model
from tests.engines.conftest import encode
from tests.engines.test_packing import (
    ATOL,
    CPU,
    _alone,
    _batch,
    _eager_copy,
    _logprobs,
    assert_same_gradients,
)

GQA = TinyModelSpec(hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, seed=5)
GPT2 = TinyModelSpec(arch="gpt2", hidden=32, layers=2, heads=4, intermediate=64, seed=3)


@pytest.fixture(params=["qwen2", "qwen2-gqa", "gpt2"])
def any_model(request: pytest.FixtureRequest, model: PreTrainedModel,
              tok: PreTrainedTokenizerFast) -> PreTrainedModel:
    return {"qwen2": lambda: model, "qwen2-gqa": lambda: build_model(GQA, tok),
            "gpt2": lambda: build_model(GPT2, tok)}[request.param]()


@pytest.fixture(params=["materialized", "sdpa"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways a piece of the attention computes on a CPU: its scores materialised (these tests'
    sizes, below MATERIALIZED_MAX_SCORES), or SDPA's kernel (the threshold at 0, as for large pieces)."""
    if request.param == "sdpa":
        monkeypatch.setattr(prefix_attention, "MATERIALIZED_MAX_SCORES", 0)
    return str(request.param)


@pytest.mark.parametrize("max_row_tokens", [4096, 9, 2])
def test_logprobs_equal_the_padded_rows_and_the_truth(
    any_model: PreTrainedModel, tok: PreTrainedTokenizerFast, max_row_tokens: int, kernel: str
) -> None:
    prompts, responses = _batch(tok)
    any_model.eval()
    assert prefix_attention.enable(any_model)
    calls = prefix_attention.layout_calls
    with torch.no_grad():
        got = _logprobs(any_model, "packed", prompts, responses, shared_prefix=True, max_row_tokens=max_row_tokens)
        assert prefix_attention.layout_calls > calls  # the layout reached the attention
        torch.testing.assert_close(got, _logprobs(any_model, "padded", prompts, responses), atol=ATOL, rtol=0)
        torch.testing.assert_close(got, _alone(any_model, prompts, responses), atol=ATOL, rtol=0)


@pytest.mark.parametrize("max_row_tokens", [4096, 9])
def test_gradients_equal_the_dense_mask(
    any_model: PreTrainedModel, tok: PreTrainedTokenizerFast, max_row_tokens: int, kernel: str
) -> None:
    prompts, responses = _batch(tok)

    def shared(m: torch.nn.Module) -> Tensor:
        assert prefix_attention.enable(m)
        return _logprobs(m, "packed", prompts, responses, shared_prefix=True, max_row_tokens=max_row_tokens)

    assert_same_gradients(any_model, responses, shared,
                          lambda m: _logprobs(m, "packed", prompts, responses, max_row_tokens=max_row_tokens))


def _equal_groups(tok: PreTrainedTokenizerFast) -> tuple[list[Tensor], list[Tensor]]:
    """Three prompts with three completions each, in group order (how GRPO's micro-batches arrive)."""
    g = torch.Generator().manual_seed(11)
    prompts = encode(tok, [text for text in ("12+34=", "7=", "123*456=") for _ in range(3)])
    return prompts, [torch.randint(3, len(tok), (n,), generator=g) for n in (5, 2, 4, 3, 6, 3, 4, 4, 2)]


def test_equal_groups_broadcast_their_prompt_keys(any_model: PreTrainedModel, tok: PreTrainedTokenizerFast) -> None:
    """Every prompt with as many completions, in order: each completion's prompt keys are a broadcast
    (``completions_per_prompt``), not a gather; same logprobs and gradients as the dense mask."""
    prompts, responses = _equal_groups(tok)
    layout = packed_inputs(prompts, responses, CPU, mask_dtype=None, shared_prefix=True).shared_prefix
    assert layout is not None and layout.completions_per_prompt == 3
    for split in (packed_inputs(prompts, responses, CPU, mask_dtype=None, shared_prefix=True, max_row_tokens=9),
                  packed_inputs(*_batch(tok), CPU, mask_dtype=None, shared_prefix=True)):
        # groups split over rows, or of 4, 3 and 1 samples interleaved: gathered
        assert split.shared_prefix is not None and split.shared_prefix.completions_per_prompt is None

    def shared(m: torch.nn.Module) -> Tensor:
        assert prefix_attention.enable(m)
        return _logprobs(m, "packed", prompts, responses, shared_prefix=True)

    with torch.no_grad():
        torch.testing.assert_close(shared(copy.deepcopy(any_model).eval()), _alone(any_model.eval(), prompts, responses),
                                   atol=ATOL, rtol=0)
    assert_same_gradients(any_model, responses, shared, lambda m: _logprobs(m, "packed", prompts, responses))


def test_the_layout_allows_exactly_what_the_dense_mask_allows(tok: PreTrainedTokenizerFast) -> None:
    """Rebuild a dense [rows, width, width] mask from the layout: equal to packing's own on every real query."""
    prompts, responses = _batch(tok)
    for max_row_tokens in (4096, 9, 2):
        inputs = packed_inputs(prompts, responses, CPU, mask_dtype=None, max_row_tokens=max_row_tokens,
                               shared_prefix=True, dense_mask=True)
        layout = inputs.shared_prefix
        assert layout is not None
        rows, width = inputs.kwargs["input_ids"].shape
        assert layout.tokens == rows * width
        # every real token reads the output of exactly one real query of the two pieces, its own
        valid = torch.cat([layout.prompt_valid.reshape(-1), layout.completion_valid.reshape(-1)])
        real = (layout.output_index != valid.numel()).nonzero().squeeze(1)  # the rest read the zero row
        read = layout.output_index[real]
        assert torch.equal(read.sort().values, valid.nonzero().squeeze(1))
        allowed = torch.zeros(rows * width, rows * width, dtype=torch.bool)
        for index, valid, mask, keys in (
            (layout.prompt_index, layout.prompt_valid, layout.prompt_mask[:, 0], layout.prompt_index),
            (layout.completion_index, layout.completion_valid, layout.completion_mask[:, 0],
             torch.cat([layout.prompt_index.index_select(0, layout.completion_prompt), layout.completion_index], 1)),
        ):
            for n in range(index.shape[0]):
                for i in valid[n].nonzero().squeeze(1).tolist():
                    allowed[index[n, i], keys[n][mask[n, i]]] = True
        dense = inputs.kwargs["attention_mask"][:, 0]  # [rows, width, width]
        flat = torch.zeros_like(allowed)
        for r in range(rows):
            flat[r * width:(r + 1) * width, r * width:(r + 1) * width] = dense[r]
        queries = real
        assert torch.equal(allowed[queries], flat[queries]), max_row_tokens


def test_without_a_layout_it_is_sdpa(model: PreTrainedModel, tok: PreTrainedTokenizerFast) -> None:
    """Calls that carry no layout (padded rows, generation with a KV cache) compute what sdpa does, bit for bit."""
    prompts, responses = _batch(tok)
    model.eval()
    switched = copy.deepcopy(model)
    assert prefix_attention.enable(switched)
    assert switched.config._attn_implementation == prefix_attention.IMPLEMENTATION
    with torch.no_grad():
        for path in ("padded", "packed"):
            assert torch.equal(_logprobs(switched, path, prompts, responses),
                               _logprobs(model, path, prompts, responses))
        ids = prompts[0].unsqueeze(0)
        kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": tok.pad_token_id}
        assert torch.equal(switched.generate(ids, **kwargs), model.generate(ids, **kwargs))
    prefix_attention.disable(switched)
    assert switched.config._attn_implementation == "sdpa"


def test_the_switch_is_not_saved_with_the_model(
    model: PreTrainedModel, tmp_path: pytest.TempPathFactory
) -> None:
    """A checkpoint of a switched model loads anywhere: its config does not name this implementation."""
    assert prefix_attention.enable(model)
    model.save_pretrained(tmp_path)  # type: ignore[arg-type]
    text = (tmp_path / "config.json").read_text()  # type: ignore[operator]
    assert prefix_attention.IMPLEMENTATION not in text and json.loads(text)["model_type"] == "qwen2"
    prefix_attention.disable(model)


class _DropsKwargs(Qwen2ForCausalLM):
    """A causal LM whose forward does not hand extra keyword arguments on to its attention."""

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,  # type: ignore[override]
                position_ids: Tensor | None = None, logits_to_keep: int = 0, **kwargs: object) -> object:
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               logits_to_keep=logits_to_keep, use_cache=False)


def test_the_probe_uses_it_only_where_it_is_exact(model: PreTrainedModel, tok: PreTrainedTokenizerFast) -> None:
    on, why = probe_shared_prefix(copy.deepcopy(model), CPU)
    assert on and "shared-prefix attention" in why
    eager = _eager_copy(model)
    on, why = probe_shared_prefix(eager, CPU)
    assert not on and "eager attention" in why and eager.config._attn_implementation == "eager"
    drops = _DropsKwargs(model.config)
    drops.load_state_dict(model.state_dict())
    drops.config._attn_implementation = "sdpa"
    on, why = probe_shared_prefix(drops, CPU)
    assert not on and "does not pass the layout" in why
    assert drops.config._attn_implementation == "sdpa"  # put back as found

    forward = ResponseForward(copy.deepcopy(model), CPU)
    assert forward.path == "packed" and forward.shared_prefix and "shared-prefix attention" in forward.why
    off = ResponseForward(copy.deepcopy(model), CPU, shared_prefix=False)
    assert off.path == "packed" and not off.shared_prefix and "shared_prefix is off" in off.why
    assert off.model.config._attn_implementation == "sdpa"
    engine = LogprobEngine(copy.deepcopy(model).requires_grad_(False), device="cpu")
    assert engine.forward.shared_prefix
    prompts, responses = _batch(tok)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(engine.logprobs(prompts, responses)),
                                   _alone(model, prompts, responses), atol=ATOL, rtol=0)


def test_a_micro_batch_of_one_token_responses(model: PreTrainedModel, tok: PreTrainedTokenizerFast) -> None:
    """No completion has an input token (every response is EOS alone, or empty): only the prompts attend."""
    prompts, _ = _batch(tok)
    responses = [torch.tensor([4 + i % 3]) if i % 4 else torch.zeros(0, dtype=torch.int64)
                 for i in range(len(prompts))]
    layout = packed_inputs(prompts, responses, CPU, mask_dtype=None, shared_prefix=True).shared_prefix
    assert layout is not None and layout.completion_prompt.numel() == 0
    switched = copy.deepcopy(model).train()
    assert prefix_attention.enable(switched)
    got = _logprobs(switched, "packed", prompts, responses, shared_prefix=True)
    got.sum().backward()
    assert all(p.grad is not None for p in switched.parameters() if p.requires_grad)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(got.detach(), _alone(model, prompts, responses), atol=ATOL, rtol=0)


def _real_tokens(prompts: list[Tensor], responses: list[Tensor]) -> int:
    """Tokens of a packed micro-batch without padding: each distinct prompt once, each response's inputs."""
    return (sum(len(p) for p in {tuple(p.tolist()) for p in prompts})
            + sum(max(r.numel() - 1, 0) for r in responses))


def test_narrow_rows_keep_the_dense_mask(model: PreTrainedModel, tok: PreTrainedTokenizerFast) -> None:
    """Below ``shared_prefix_min_width`` (tokens of the widest one-group row) and
    ``shared_prefix_min_padding`` (tokens such rows would pad) a micro-batch builds no layout and runs
    sdpa exactly; from either on, the layout reaches the attention."""
    prompts, responses = _batch(tok)
    dense = packed_inputs(prompts, responses, CPU, mask_dtype=None)
    rows, width = dense.kwargs["input_ids"].shape
    padding = rows * width - _real_tokens(prompts, responses)
    assert width < DEFAULT_SHARED_PREFIX_MIN_WIDTH and 0 < padding < DEFAULT_SHARED_PREFIX_MIN_PADDING
    cases = [(DEFAULT_SHARED_PREFIX_MIN_WIDTH, DEFAULT_SHARED_PREFIX_MIN_PADDING, False),
             (width + 1, padding + 1, False), (width, padding + 1, True), (width + 1, padding, True)]
    for min_width, min_padding, used in cases:
        forward = ResponseForward(copy.deepcopy(model).eval(), CPU, shared_prefix_min_width=min_width,
                                  shared_prefix_min_padding=min_padding)
        assert forward.shared_prefix
        calls = prefix_attention.layout_calls
        with torch.no_grad():
            got, _ = forward.logprobs(prompts, responses, 1.0)
        assert (prefix_attention.layout_calls > calls) == used, (min_width, min_padding)
        torch.testing.assert_close(got, _alone(model.eval(), prompts, responses), atol=ATOL, rtol=0)


def test_the_layout_fills_rows_and_the_mask_is_a_placeholder(tok: PreTrainedTokenizerFast) -> None:
    """With the layout, the groups share rows (no row padded to the widest group) and the forward gets
    a zero-stride stand-in for the dense mask, which the layout's attention never reads."""
    prompts, responses = _batch(tok)
    real = _real_tokens(prompts, responses)
    inputs = packed_inputs(prompts, responses, CPU, mask_dtype=None, shared_prefix=True)
    assert inputs.kwargs["input_ids"].shape == (1, real)  # three prompt occurrences in one row, nothing padded
    assert inputs.shared_prefix is not None and inputs.shared_prefix.prompt_index.shape[0] == 3
    mask = inputs.kwargs["attention_mask"]
    assert mask.shape == (1, 1, real, real) and mask.stride()[2:] == (0, 0)
    dense = packed_inputs(prompts, responses, CPU, mask_dtype=None, shared_prefix=True, dense_mask=True)
    assert torch.equal(dense.kwargs["input_ids"], inputs.kwargs["input_ids"])
    assert not bool(dense.kwargs["attention_mask"].all())  # the real mask: groups do not see each other


def test_filled_rows_share_the_tokens_evenly(model: PreTrainedModel, tok: PreTrainedTokenizerFast) -> None:
    """A micro-batch over ``max_row_tokens`` fills rows of about equal width (each closed once it
    holds its share), not full rows and a short last one padded to their width; logprobs unchanged."""
    prompts, responses = _batch(tok)
    one_row = packed_inputs(prompts, responses, CPU, mask_dtype=None, shared_prefix=True).width
    max_row_tokens = one_row - 2
    inputs = packed_inputs(prompts, responses, CPU, mask_dtype=None, shared_prefix=True, max_row_tokens=max_row_tokens)
    rows, width = inputs.kwargs["input_ids"].shape
    assert rows == 2 and width <= one_row // 2 + 8  # 8: the widest completion and prompt that may cross the half
    model.eval()
    assert prefix_attention.enable(model)
    with torch.no_grad():
        got = _logprobs(model, "packed", prompts, responses, shared_prefix=True, max_row_tokens=max_row_tokens)
        torch.testing.assert_close(got, _alone(model, prompts, responses), atol=ATOL, rtol=0)


def test_a_layout_for_a_model_without_the_shared_prefix_attention_is_refused(
        model: PreTrainedModel, tok: PreTrainedTokenizerFast) -> None:
    """Its mask is a placeholder: a model whose attention would read it instead of the layout gets an
    error naming the fix, not wrong logprobs."""
    prompts, responses = _batch(tok)
    inputs = packed_inputs(prompts, responses, CPU, mask_dtype=None, shared_prefix=True)
    plain = copy.deepcopy(model)
    with pytest.raises(ValueError, match=r"prefix_attention\.enable"):
        response_logits(plain, inputs)


def test_a_sliding_window_with_a_layout_is_refused(model: PreTrainedModel, tok: PreTrainedTokenizerFast) -> None:
    """The layout does not encode a window's band, and the mask beside it is a placeholder: refused,
    never computed wrong (the probe then keeps the dense mask)."""
    prompts, responses = _batch(tok)
    layout = packed_inputs(prompts, responses, CPU, mask_dtype=None, shared_prefix=True).shared_prefix
    q = torch.zeros(1, 4, layout.tokens, 8)
    with pytest.raises(ValueError, match="sliding window"):
        prefix_attention.shared_prefix_attention(model, q, q, q, None, shared_prefix=layout, sliding_window=4)
