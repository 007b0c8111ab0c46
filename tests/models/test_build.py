"""Tiny model construction (same weights as the baseline), save/load, device resolution."""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import types
from pathlib import Path

import msgspec
import pytest
import torch

from streamrl.models.build import (
    DeviceUnavailableError,
    ModelLoadError,
    TinyModelSpec,
    build_model,
    load_model,
    resolve_device,
    save_pretrained_dir,
)
from streamrl.models.tokenizer import build_char_tokenizer

SMALL = TinyModelSpec(hidden=32, layers=2, heads=4, intermediate=64)


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_spec_defaults_are_workload_w1() -> None:
    spec = TinyModelSpec()
    assert (spec.arch, spec.hidden, spec.layers, spec.heads, spec.intermediate) == ("qwen2", 128, 2, 4, 256)
    assert (spec.kv_heads, spec.max_positions, spec.tie_embeddings, spec.seed) == (None, 64, False, 0)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"hidden": 30}, "multiple of heads"),
        ({"kv_heads": 3}, "kv_heads"),
        ({"layers": 0}, "layers"),
        ({"arch": "gpt2", "kv_heads": 2}, r"TinyModelSpec\.kv_heads must be left unset \(null\) for arch gpt2"),
        ({"arch": "gpt2", "tie_embeddings": False}, r"TinyModelSpec\.tie_embeddings=false is not possible.*gpt2"),
    ],
)
def test_spec_rejects_bad_shapes(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        TinyModelSpec(**kwargs)


def test_build_is_seeded_and_leaves_the_global_rng_alone() -> None:
    tok = build_char_tokenizer()
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_model(SMALL, tok)
    after = torch.rand(1)
    assert torch.equal(before, after)
    assert _same_weights(a, build_model(SMALL, tok))
    other = build_model(TinyModelSpec(hidden=32, layers=2, heads=4, intermediate=64, seed=1), tok)
    assert not _same_weights(a, other)
    cfg = a.config
    assert (cfg.model_type, cfg.vocab_size, cfg.num_key_value_heads, cfg.tie_word_embeddings) == ("qwen2", 15, 4, False)
    assert (cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id) == (1, 0, None)
    llama = build_model(TinyModelSpec(arch="llama", hidden=32, layers=1, heads=4, kv_heads=2, intermediate=64), tok)
    assert llama.config.model_type == "llama" and llama.config.num_key_value_heads == 2


GPT2 = TinyModelSpec(arch="gpt2", hidden=32, layers=2, heads=4, intermediate=64, max_positions=48)


def test_tie_embeddings_defaults_to_the_architectures_choice() -> None:
    assert TinyModelSpec().tie_embeddings is False and TinyModelSpec(arch="llama").tie_embeddings is False
    assert TinyModelSpec(arch="gpt2").tie_embeddings is True
    assert TinyModelSpec(arch="gpt2", tie_embeddings=True).tie_embeddings is True
    assert TinyModelSpec(tie_embeddings=True).tie_embeddings is True


def test_gpt2_build() -> None:
    tok = build_char_tokenizer()
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    model = build_model(GPT2, tok)
    assert torch.equal(before, torch.rand(1))  # the global RNG is left alone, as for the other archs
    assert _same_weights(model, build_model(GPT2, tok))
    assert not _same_weights(model, build_model(msgspec.structs.replace(GPT2, seed=1), tok))
    cfg = model.config
    assert (cfg.model_type, cfg.vocab_size, cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.n_inner, cfg.n_positions) == (
        "gpt2", len(tok), 32, 2, 4, 64, 48
    )
    assert (cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id, cfg.tie_word_embeddings) == (1, 0, None, True)
    assert (cfg.resid_pdrop, cfg.embd_pdrop, cfg.attn_pdrop, cfg.summary_first_dropout) == (0.0, 0.0, 0.0, 0.0)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.transformer.wpe.weight.shape == (48, 32)  # learned positions: one row per position
    assert (model.generation_config.eos_token_id, model.generation_config.pad_token_id) == (1, 0)
    # No dropout: a forward in train mode gives the eval-mode numbers.
    ids = torch.tensor([tok("12+34=")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(model.train()(ids).logits, model.eval()(ids).logits, rtol=0, atol=0)


def test_gpt2_save_and_load_roundtrip(tmp_path: Path) -> None:
    tok = build_char_tokenizer()
    model = build_model(GPT2, tok).eval()
    save_pretrained_dir(model, tok, tmp_path / "g")
    loaded = load_model(tmp_path / "g").eval()
    assert type(loaded).__name__ == "GPT2LMHeadModel" and loaded.dtype == torch.float32
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # still tied after the round trip
    assert _same_weights(loaded, model)
    ids = torch.tensor([tok("1+2=")["input_ids"], tok("9+8=")["input_ids"]])
    with torch.no_grad():
        logits = loaded(ids).logits
        torch.testing.assert_close(logits, model(ids).logits, rtol=0, atol=0)
    assert logits.shape == (2, 4, len(tok)) and bool(logits.isfinite().all())


def test_same_weights_as_the_baseline_build(baseline: types.ModuleType) -> None:
    args = argparse.Namespace(hidden=128, intermediate=256, layers=2, heads=4, max_positions=64, seed=0)
    theirs = baseline.build_model(baseline.build_tokenizer(), args)
    assert _same_weights(theirs, build_model(TinyModelSpec(), build_char_tokenizer()))


# sha256 over (name, bytes) of every tensor of the reference TRL baseline's model for W1's shapes
# (hidden 128, 2 layers, 4 heads, intermediate 256, 64 positions, seed 0), recorded from the reference
# script on 2026-11-23: the check above runs live where that script is available, this one everywhere.
BASELINE_W1_WEIGHTS_SHA256 = "b34a42553d5dd502636853183523be934908b2f863de5b68b280382ebf3f39ac"


def test_same_weights_as_the_baseline_fingerprint() -> None:
    h = hashlib.sha256()
    for name, tensor in build_model(TinyModelSpec(), build_char_tokenizer()).state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().contiguous().numpy().tobytes())
    assert h.hexdigest() == BASELINE_W1_WEIGHTS_SHA256


def test_save_and_load_roundtrip(tmp_path: Path) -> None:
    tok = build_char_tokenizer()
    model = build_model(SMALL, tok).eval()
    save_pretrained_dir(model, tok, tmp_path / "m")
    loaded = load_model(tmp_path / "m").eval()
    assert loaded.dtype == torch.float32
    ids = torch.tensor([tok("1+2=")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    assert (tmp_path / "m" / "model.safetensors").is_file()
    assert (tmp_path / "m" / "tokenizer.json").is_file()


def test_load_errors_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match=r"empty.*config\.json"):
        load_model(empty)
    (empty / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_model(empty)
    (empty / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(empty)
    (empty / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ModelLoadError, match="could not load model from"):
        load_model(empty)


def test_resolve_device() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else None
    if expected is None:
        assert resolve_device("auto").type in ("cpu", "npu")
        with pytest.raises(DeviceUnavailableError, match="CUDA is not available"):
            resolve_device("cuda:1")
    else:
        assert resolve_device("auto").type == "cuda"
        with pytest.raises(DeviceUnavailableError, match="device"):
            resolve_device(f"cuda:{torch.cuda.device_count()}")
    with pytest.raises(DeviceUnavailableError, match="unknown device"):
        resolve_device("tpu")
    with pytest.raises(DeviceUnavailableError, match="must be a number"):
        resolve_device("cuda:x")
    if importlib.util.find_spec("torch_npu") is None:
        with pytest.raises(DeviceUnavailableError, match="NPU"):
            resolve_device("npu")
