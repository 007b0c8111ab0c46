"""Generated tokens/s of vLLM, the built-in engine and transformers' generate, side by side, and the
time to install one policy version in vLLM versus model size, on W2's model, a ~30M and a
~90M-parameter one.

    .venv-vllm/bin/python ops/bench/rollout_engines.py [--repeats 3] [--models w2,30m,90m] [--no-separate]

Install time is measured on both of the engine's weight paths: in-process (the separate
placement: tensors handed to vLLM's reload_weights) and with vLLM's engine core in its own process
(the disaggregated placement: safetensors files of <= 64 MiB in shared memory); the latter starts
a second engine per model (~40-60 s on 2 cores), --no-separate skips it.

Same prompts (16 ragged digit strings x 8 samples), same sampling (temperature 1.0, max 32 new
tokens, no EOS stop for a fixed token count) for every engine. Needs the vLLM environment
(ops/vllm_env.sh). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ops.bench._common import fmt_spread, print_json_line, print_table, ratio, spread
from streamrl.engines.options import VllmOptions
from streamrl.engines.rollout import TorchRolloutEngine
from streamrl.models.build import TinyModelSpec, build_model, save_pretrained_dir
from streamrl.models.tokenizer import build_char_tokenizer

MODELS = {
    "w2": TinyModelSpec(hidden=256, layers=4, heads=8, intermediate=512, max_positions=128, seed=0),
    "30m": TinyModelSpec(hidden=512, layers=8, heads=8, intermediate=1536, max_positions=128, seed=0),
    "90m": TinyModelSpec(hidden=1024, layers=8, heads=16, intermediate=2048, max_positions=128, seed=0),
}
PROMPTS, SAMPLES, NEW = 16, 8, 32


def prompts(tok: object) -> list[torch.Tensor]:
    rng = random.Random(0)
    texts = ["".join(rng.choice("0123456789") for _ in range(rng.randint(2, 24))) + "=" for _ in range(PROMPTS)]
    ids = [torch.tensor(tok(t)["input_ids"], dtype=torch.int64) for t in texts]  # type: ignore[operator]
    return [p for p in ids for _ in range(SAMPLES)]


def bench_model(key: str, tok: Any, repeats: int, separate: bool) -> tuple[dict[str, Any], float]:
    """One model's figures and vLLM's start-up seconds."""
    from streamrl.engines.vllm_engine import VllmRolloutEngine

    model = build_model(MODELS[key], tok).eval()
    n_params = sum(p.numel() for p in model.parameters())
    batch = prompts(tok)
    no_eos = -1  # fixed-length generation: every engine makes exactly NEW tokens per sample
    builtin = TorchRolloutEngine(model, no_eos, tok.pad_token_id, "cpu")
    scratch = Path(tempfile.mkdtemp(prefix="srl-bench-vllm-"))
    vllm = VllmRolloutEngine(save_pretrained_dir(model, tok, scratch / "model"), eos_token_id=None,
                             dtype="float32", max_model_len=128, seed=0,
                             options=VllmOptions(cpu_threads_bind="0-1"), scratch_dir=scratch)
    tokens = len(batch) * NEW

    def run_builtin() -> float:
        t = time.perf_counter()
        gens = builtin.generate(batch, max_new_tokens=NEW, generator=torch.Generator().manual_seed(0))
        return sum(g.response_ids.numel() for g in gens) / (time.perf_counter() - t)

    def run_vllm() -> float:
        t = time.perf_counter()
        gens = vllm.generate(batch, max_new_tokens=NEW, generator=torch.Generator().manual_seed(0))
        # the saved generation_config's EOS may still end a few early: count what was made
        return sum(g.response_ids.numel() for g in gens) / (time.perf_counter() - t)

    def run_hf() -> float:
        padded = torch.nn.utils.rnn.pad_sequence([p.flip(0) for p in batch], batch_first=True,
                                                 padding_value=tok.pad_token_id).flip(1)
        mask = (padded != tok.pad_token_id).long()
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(padded, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=True,
                           pad_token_id=tok.pad_token_id)
        return tokens / (time.perf_counter() - t)

    def install() -> float:
        t = time.perf_counter()
        vllm.load_weights(model.state_dict().items())
        return time.perf_counter() - t

    startup_s = vllm.startup_s
    run_vllm(), run_builtin()  # warm-up (vLLM's first batch builds its kernels' caches)
    res = {name: spread(fn() for _ in range(repeats))
           for name, fn in (("vllm", run_vllm), ("builtin", run_builtin), ("hf_generate", run_hf))}
    res["install_s"] = spread(install() for _ in range(repeats))
    vllm.close()
    if separate:
        scratch = Path(tempfile.mkdtemp(prefix="srl-bench-vllm-"))
        vllm = VllmRolloutEngine(save_pretrained_dir(model, tok, scratch / "model"), eos_token_id=None,
                                 dtype="float32", max_model_len=128, seed=0,
                                 options=VllmOptions(cpu_threads_bind="0-1"), scratch_dir=scratch,
                                 separate_process=True)
        try:
            res["install_separate_s"] = spread(install() for _ in range(repeats))
        finally:
            vllm.close()
    return {"params": n_params, **res}, startup_s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default="w2,30m,90m")
    ap.add_argument("--no-separate", action="store_true", help="skip the separate-process install path")
    args = ap.parse_args()
    tok = build_char_tokenizer()
    figures: dict[str, dict[str, object]] = {}
    rows = []
    for key in args.models.split(","):
        res, startup_s = bench_model(key, tok, args.repeats, not args.no_separate)
        n_params = res["params"]
        figures[key] = {**res, "vllm_startup_s": startup_s}
        rows.append([key, f"{n_params / 1e6:.1f}M", fmt_spread(res["vllm"], 0), fmt_spread(res["builtin"], 0),
                     fmt_spread(res["hf_generate"], 0), f"{ratio(res['vllm'], res['builtin']):.2f}",
                     f"{ratio(res['vllm'], res['hf_generate']):.2f}", fmt_spread(res["install_s"], 3),
                     fmt_spread(res["install_separate_s"], 3) if "install_separate_s" in res else "-",
                     f"{startup_s:.1f}"])
    print_table(["model", "params", "vLLM tok/s", "builtin tok/s", "HF generate tok/s", "vLLM/builtin",
                 "vLLM/HF", "install s (in-process)", "install s (own process)", "vLLM start s"], rows)
    print_json_line(
        "rollout_engines",
        {k: {"vllm_tok_s": v["vllm"], "install_s": v["install_s"], "install_separate_s": v.get("install_separate_s"),
             "params": v["params"]} for k, v in figures.items()},
        {k: {"builtin_tok_s": v["builtin"], "hf_generate_tok_s": v["hf_generate"]} for k, v in figures.items()},
        {k: {"vllm_over_builtin": ratio(v["vllm"], v["builtin"]),  # type: ignore[arg-type]
             "vllm_over_hf": ratio(v["vllm"], v["hf_generate"])} for k, v in figures.items()},  # type: ignore[arg-type]
        {"default_engine": "the faster of vllm / builtin on the W2 model"},
        load=os.getloadavg()[0],
    )


if __name__ == "__main__":
    main()
