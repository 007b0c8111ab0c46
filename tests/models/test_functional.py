"""The functional forward equals the Hugging Face forward (fp32 logits: packed prefill, cached decoding)."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, MistralConfig, MistralForCausalLM

from streamrl.models.build import TinyModelSpec, build_model
from streamrl.models.functional import FunctionalCausalLM, KVCache, UnsupportedModelError, unsupported_reason
from streamrl.models.tokenizer import build_char_tokenizer

SPECS = {
    "qwen2": TinyModelSpec(hidden=32, layers=2, heads=4, intermediate=64, seed=1),
    "llama-gqa": TinyModelSpec(arch="llama", hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, seed=2),
}
ATOL = 1e-5


def _mistral() -> torch.nn.Module:
    """Mistral without a sliding window: the Llama layout, no biases (TinyModelSpec builds no Mistral)."""
    torch.manual_seed(3)
    config = MistralConfig(vocab_size=15, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=None)
    return MistralForCausalLM(config)


@pytest.fixture(params=[*sorted(SPECS), "mistral"])
def model(request: pytest.FixtureRequest) -> torch.nn.Module:
    if request.param == "mistral":
        return _mistral().eval()
    return build_model(SPECS[request.param], build_char_tokenizer()).eval()


def _rows(seed: int, lengths: list[int]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 15, (n,), generator=g) for n in lengths]


def _hf_logits(model: torch.nn.Module, row: torch.Tensor) -> torch.Tensor:
    return model(row.unsqueeze(0)).logits[0]


def _pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True), torch.tensor([len(r) for r in rows])


@torch.no_grad()
def test_packed_forward_equals_hf_logits(model: torch.nn.Module) -> None:
    fn = FunctionalCausalLM(model)
    for lengths in ([5, 9, 1, 9], [4, 4, 4]):  # ragged (packed path) and equal (dense path)
        rows = _rows(0, lengths)
        ids, lens = _pad(rows)
        hidden, pack = fn.forward_packed(ids, lens)
        assert hidden.shape[0] == sum(lengths) == pack.positions.numel()
        expected = torch.cat([_hf_logits(model, r) for r in rows])
        torch.testing.assert_close(fn.logits(hidden), expected, atol=ATOL, rtol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("row_prompt", [[1, 0, 2, 1, 1, 0], [0, 0, 1, 1, 2, 2]], ids=["any-order", "regular"])
def test_cached_decoding_equals_hf_logits(model: torch.nn.Module, row_prompt: list[int]) -> None:
    """Rows in any order (grouped by scatter) or side by side per prompt (grouped by views), before
    and after finished rows leave; twice on one cache, with more columns than steps, so the
    second call decodes over the value columns the first one left (read with probability 0)."""
    fn = FunctionalCausalLM(model)
    prompts = _rows(4, [2, 5, 3])
    ids, lens = _pad(prompts)
    steps = 5
    cache = KVCache(fn.n_layers, fn.n_kv_heads, fn.head_dim, dtype=torch.float32, device=torch.device("cpu"))
    for call in range(2):
        kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        fn.forward_packed(ids, lens, kv_out=kv)
        cache.start(kv, lens, row_prompt, columns=20)
        assert cache.regular == (row_prompt == sorted(row_prompt))
        seqs = [prompts[u].clone() for u in row_prompt]
        nxt = torch.tensor([7, 8, 9, 10, 11, 12]) + call
        positions = lens[torch.tensor(row_prompt)]
        for t in range(steps):
            if t == 3:  # drop rows 1 and 4 (finished sequences leave the batch)
                keep = [0, 2, 3, 5]
                cache.select_rows(keep, columns=t)
                assert not cache.regular  # prompts now have 1 or 2 rows
                seqs, nxt, positions = [seqs[k] for k in keep], nxt[keep], positions[keep]
            logits = fn.decode_step(nxt, positions + t, cache, step=t)
            seqs = [torch.cat([s, nxt[i : i + 1]]) for i, s in enumerate(seqs)]
            expected = torch.stack([_hf_logits(model, s)[-1] for s in seqs])
            torch.testing.assert_close(logits, expected, atol=ATOL, rtol=1e-5)
            nxt = logits.argmax(-1)


@torch.no_grad()
def test_each_one_reads_the_weights_of_its_construction(model: torch.nn.Module) -> None:
    """Updated in place (an optimizer step), through load_state_dict, or rebound with ``.data`` to
    another tensor at the same address (what the colocated view engine does each call, where a
    version counter sees nothing): a FunctionalCausalLM built afterwards computes with them."""
    ids, lens = _pad(_rows(5, [4]))

    def logits() -> torch.Tensor:
        fn = FunctionalCausalLM(model)
        return fn.logits(fn.forward_packed(ids, lens)[0])

    before = logits()
    for weight in (model.model.layers[0].mlp.down_proj.weight, model.model.layers[1].self_attn.k_proj.weight,
                   model.model.layers[0].mlp.up_proj.weight):
        weight.mul_(2.0)
        after = logits()
        assert not torch.allclose(before, after)
        torch.testing.assert_close(after, _hf_logits(model, ids[0]), atol=ATOL, rtol=1e-5)
        before = after
    model.load_state_dict({k: v * 0.5 for k, v in model.state_dict().items()})
    torch.testing.assert_close(logits(), _hf_logits(model, ids[0]), atol=ATOL, rtol=1e-5)
    q = model.model.layers[0].self_attn.q_proj.weight
    buffer = q.detach().clone()
    q.data = buffer
    version = q._version
    buffer.mul_(3.0)  # rewritten behind the parameter's back
    assert q._version == version
    torch.testing.assert_close(logits(), _hf_logits(model, ids[0]), atol=ATOL, rtol=1e-5)


def test_unsupported_architecture_is_named() -> None:
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=15, n_embd=16, n_layer=1, n_head=2, n_positions=16))
    assert "gpt2" in (unsupported_reason(gpt2) or "")
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        FunctionalCausalLM(gpt2)


@torch.no_grad()
def test_a_projection_without_a_bias_beside_biased_ones() -> None:
    """q and v with a bias, k without (the fused q|k|v bias gets zeros for k): HF's logits."""
    model = build_model(SPECS["qwen2"], build_char_tokenizer()).eval()
    model.model.layers[0].self_attn.k_proj.bias = None
    ids, lens = _pad(_rows(6, [7]))
    fn = FunctionalCausalLM(model)
    torch.testing.assert_close(fn.logits(fn.forward_packed(ids, lens)[0]), _hf_logits(model, ids[0]), atol=ATOL,
                               rtol=1e-5)
