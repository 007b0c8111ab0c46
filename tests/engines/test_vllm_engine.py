"""The vLLM rollout engine against the built-in engine, plain transformers and the trainer's recompute.

Runs where vLLM is installed (the second environment ``.ci/run`` builds; docs/vllm.md): one engine
for the whole module, since start-up costs seconds. Elsewhere the module is skipped.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

pytest.importorskip("vllm", reason="vLLM is not installed in this environment (docs/vllm.md: the vLLM test env)")

from streamrl.engines.logprob import LogprobEngine
from streamrl.engines.options import VllmOptions
from streamrl.engines.rollout import TorchRolloutEngine
from streamrl.engines.vllm_engine import VllmRolloutEngine
from streamrl.models.build import TinyModelSpec, build_model, save_pretrained_dir
from tests.engines.conftest import constant_model, encode

# vLLM's CPU attention has kernels for head_dim 32 and up (8, the other engine tests' size, is refused)
TINY = TinyModelSpec(hidden=64, layers=2, heads=2, intermediate=128, seed=3)

PROMPTS = ["1+2+3=", "45=", "9=", "1+2+3=", "7777777=", "45=", "8+1=", "2222="]
MAX_NEW = 12


@pytest.fixture(scope="module")
def policy(tok: PreTrainedTokenizerFast) -> PreTrainedModel:
    return build_model(TINY, tok).eval()


@pytest.fixture(scope="module")
def engine(policy: PreTrainedModel, tok: PreTrainedTokenizerFast,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmRolloutEngine]:
    scratch = tmp_path_factory.mktemp("vllm")
    model_dir = save_pretrained_dir(policy, tok, scratch / "model")
    eng = VllmRolloutEngine(model_dir, eos_token_id=tok.eos_token_id, dtype="float32", max_model_len=64, seed=0,
                            options=VllmOptions(cpu_threads_bind="0-1" if (os.cpu_count() or 1) >= 2 else None),
                            scratch_dir=scratch)
    try:
        yield eng
    finally:
        eng.close()
    assert not scratch.exists(), "close() leaves its scratch directory behind"


def _greedy(engine: VllmRolloutEngine | TorchRolloutEngine, prompts: list[torch.Tensor]) -> list[list[int]]:
    gens = engine.generate(prompts, max_new_tokens=MAX_NEW, temperature=1.0, top_k=1,
                           generator=torch.Generator().manual_seed(0))
    return [g.response_ids.tolist() for g in gens]


def _hf_greedy(model: PreTrainedModel, tok: PreTrainedTokenizerFast, prompts: list[torch.Tensor]) -> list[list[int]]:
    out = []
    for p in prompts:  # one at a time: no padding question
        ids = model.generate(p.unsqueeze(0), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
        out.append(ids[0, p.numel():].tolist())
    return out


def _install(engine: VllmRolloutEngine, model: PreTrainedModel) -> None:
    """As the generate stage installs a version: a lazy iterable of (HF name, tensor)."""
    engine.load_weights((name, t) for name, t in model.state_dict().items())


def test_greedy_tokens_equal_the_builtin_engines(engine: VllmRolloutEngine, policy: PreTrainedModel,
                                                 tok: PreTrainedTokenizerFast) -> None:
    _install(engine, policy)
    prompts = encode(tok, PROMPTS)
    builtin = TorchRolloutEngine(policy, tok.eos_token_id, tok.pad_token_id, "cpu")
    got = _greedy(engine, prompts)
    assert got == _greedy(builtin, prompts)
    assert all(len(g) == MAX_NEW for g in got)  # a random model rarely says EOS: the full length is compared


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_match_the_trainers_recompute(engine: VllmRolloutEngine, policy: PreTrainedModel,
                                                       tok: PreTrainedTokenizerFast, temperature: float) -> None:
    _install(engine, policy)
    prompts = encode(tok, PROMPTS) * 4
    gens = engine.generate(prompts, max_new_tokens=MAX_NEW, temperature=temperature,
                           generator=torch.Generator().manual_seed(1))
    recompute = LogprobEngine(policy, device="cpu").logprobs(prompts, [g.response_ids for g in gens], temperature)
    rollout = torch.cat([g.logprobs for g in gens])
    trainer = torch.cat(recompute)
    # KL(rollout || trainer) estimated on the sampled tokens (k3 = r - 1 - log r, r = p_trainer / p_rollout)
    log_ratio = trainer - rollout
    kl = float((log_ratio.exp() - 1 - log_ratio).mean())
    assert kl < 1e-8, f"mean KL {kl:.3g} at temperature {temperature}"
    assert float(log_ratio.abs().max()) < 1e-4
    assert len({tuple(g.response_ids.tolist()) for g in gens}) > 8  # sampled, not greedy


def test_the_same_generator_state_draws_the_same_tokens(engine: VllmRolloutEngine, policy: PreTrainedModel,
                                                        tok: PreTrainedTokenizerFast) -> None:
    _install(engine, policy)
    prompts = encode(tok, PROMPTS)

    def draw(seed: int) -> list[list[int]]:
        gens = engine.generate(prompts, max_new_tokens=MAX_NEW, generator=torch.Generator().manual_seed(seed))
        return [g.response_ids.tolist() for g in gens]

    first = draw(7)
    assert draw(7) == first
    assert draw(8) != first
    # identical prompts in one batch get distinct draws (each request its own seed)
    assert first[0] != first[3]
    # with streams, a prompt's tokens are its stream's whatever else the call holds
    streams = [(100 + i, 0) for i in range(len(prompts))]
    together = engine.generate(prompts, max_new_tokens=MAX_NEW, streams=streams)
    alone = [engine.generate([p], max_new_tokens=MAX_NEW, streams=[s])[0] for p, s in zip(prompts, streams, strict=True)]
    assert [g.response_ids.tolist() for g in alone] == [g.response_ids.tolist() for g in together]
    assert together[0].response_ids.tolist() != together[3].response_ids.tolist()


def test_generation_follows_each_installed_version(engine: VllmRolloutEngine, policy: PreTrainedModel,
                                                   tok: PreTrainedTokenizerFast) -> None:
    prompts = encode(tok, PROMPTS)
    model = build_model(TINY, tok).eval()
    model.load_state_dict(policy.state_dict())
    seen = []
    for version in range(1, 5):
        with torch.no_grad():
            for p in model.parameters():  # a new version: every tensor moves
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(version)) * 0.3)
        _install(engine, model)
        got = _greedy(engine, prompts)
        assert got == _hf_greedy(model, tok, prompts), f"version {version}"
        seen.append(got)
    assert len({str(s) for s in seen}) == len(seen), "the versions did not change the tokens; the test proves nothing"


def test_eos_ends_a_response_and_is_kept(engine: VllmRolloutEngine, tok: PreTrainedTokenizerFast) -> None:
    _install(engine, constant_model(tok, eos_logit=60.0, spec=TINY))
    gens = engine.generate(encode(tok, PROMPTS), max_new_tokens=5, generator=torch.Generator().manual_seed(0))
    for g in gens:
        assert g.response_ids.tolist() == [tok.eos_token_id] and g.finish_reason == "eos"
        assert abs(float(g.logprobs[0])) < 1e-5
    _install(engine, constant_model(tok, eos_logit=-60.0, spec=TINY))
    gens = engine.generate(encode(tok, PROMPTS), max_new_tokens=7, generator=torch.Generator().manual_seed(0))
    for g in gens:
        assert g.response_ids.numel() == 7 and g.finish_reason == "length"
        # 14 tokens left equally likely (the char vocabulary has 15 in the model's rows that matter)
        assert torch.allclose(g.logprobs, torch.full((7,), g.logprobs[0].item()), atol=1e-5)
        assert g.logprobs[0].item() < math.log(1 / 10)


def test_a_too_long_request_is_refused_naming_the_limit(engine: VllmRolloutEngine,
                                                        tok: PreTrainedTokenizerFast) -> None:
    from streamrl.engines.rollout import GenerateArgumentError

    with pytest.raises(GenerateArgumentError, match="max_model_len 64"):
        engine.generate(encode(tok, ["1" * 60 + "="]), max_new_tokens=10, generator=torch.Generator())


def test_vllm_owns_no_ipc_files_outside_its_scratch_dir(engine: VllmRolloutEngine) -> None:
    assert os.environ["VLLM_RPC_BASE_PATH"] == str(engine.scratch_dir)
    assert Path(os.environ["VLLM_RPC_BASE_PATH"]).is_dir()
    # torch.distributed's rendezvous file, made at start-up in the temp dir: the engine's own one
    assert list(engine.scratch_dir.glob("vllm_dist_*")), sorted(p.name for p in engine.scratch_dir.iterdir())
