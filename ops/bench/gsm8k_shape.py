#!/usr/bin/env python3
"""Seconds per step of the GSM8K recipe's pipeline on a random-init Qwen2.5-0.5B-shaped model.

    python ops/bench/gsm8k_shape.py [--steps 3] [--prompts 32] [--group 8] [--max-new-tokens 512] \
        [--device cuda] [--dtype bfloat16] [--out DIR]

configs/grpo_qwen2.5_0.5b_gsm8k.yaml as it stands (pipeline, task, reward, optimizer, stage
micro-batches, max_staleness 1), with two things made here instead of downloaded: a checkpoint of
Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads / 2 KV heads, intermediate 4864, vocabulary
151,936, tied embeddings: 494M parameters) with random weights, and the small byte-level BPE
tokenizer and GSM8K-format Parquet rows of tests/e2e/hf_checkpoint.py. Evaluation is off and the
run is ``--steps`` optimizer steps long. A random model almost never samples EOS, so every
completion runs to max_new_tokens: the step is the recipe's worst case (256 x 512 generated tokens).

Per step: wall seconds (elapsed_s differences; step 1 includes warm-up), the busy fraction of
generate and train in it (busy/<stage> x wall = seconds that stage worked during the step; with
max_staleness 1 the two overlap), and the trainer's own train_ms, step_time_s and the weight
gather + publish time. The last line is the JSON line of ops/bench/_common.py.

Figures: docs/benchmarks.md §12.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from _common import print_json_line, print_table

REPO = Path(__file__).resolve().parents[2]
QWEN25_05B = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
              "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
              "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True}
TINY = {**QWEN25_05B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "vocab_size": 1024}  # --shape tiny: a smoke test of this script on a CPU


def save_checkpoint(path: Path, device: str, shape: dict) -> int:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from tests.e2e.hf_checkpoint import gsm8k_rows, train_tokenizer

    corpus = [r["question"] + " " + r["answer"] for r in gsm8k_rows(200, seed=99)]
    corpus += ["The answer is \\boxed{7}.", "Please reason step by step.", "0 1 2 3 4 5 6 7 8 9 + - = ."]
    tokenizer = train_tokenizer(corpus)
    config = Qwen2Config(**shape, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device if device.startswith("cuda") and torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(config)
    model = model.to("cpu", torch.bfloat16)
    model.generation_config = GenerationConfig(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=32, help="algo.prompts_per_step (the recipe: 32)")
    ap.add_argument("--group", type=int, default=8, help="algo.group_size (the recipe: 8)")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--shape", choices=["qwen2.5-0.5b", "tiny"], default="qwen2.5-0.5b")
    ap.add_argument("--out", default=None, help="where to write metrics.json (default: none)")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides")
    args = ap.parse_args()

    import streamrl
    from streamrl.config import load_config
    from tests.e2e.hf_checkpoint import gsm8k_rows, write_gsm8k_parquet

    tmp = Path(tempfile.mkdtemp(prefix="gsm8k_shape_"))
    t0 = time.perf_counter()
    n_params = save_checkpoint(tmp / "model", args.device, QWEN25_05B if args.shape != "tiny" else TINY)
    write_gsm8k_parquet(tmp / "data" / "train.parquet", gsm8k_rows(max(64, args.prompts * (args.steps + 2)), seed=1))
    print(f"checkpoint ({n_params / 1e6:.0f}M parameters) and data made in {time.perf_counter() - t0:.1f} s", flush=True)

    overrides = [f"model.path={tmp / 'model'}", f"model.dtype={args.dtype}",
                 f"task.options.path={tmp / 'data' / 'train.parquet'}", "task.options.eval_path=null",
                 "algo.epochs=null", f"algo.steps={args.steps}", "algo.warmup_steps=0", f"algo.prompts_per_step={args.prompts}",
                 f"algo.group_size={args.group}", f"algo.max_new_tokens={args.max_new_tokens}",
                 "eval.every=0", f"resources.device={args.device}", f"output.run_dir={tmp / 'runs'}",
                 "output.progress=lines", "output.checkpoint=false", "output.plot=false", *args.overrides]
    cfg = load_config(REPO / "configs" / "grpo_qwen2.5_0.5b_gsm8k.yaml", overrides)
    t0 = time.perf_counter()
    result = streamrl.run(cfg)
    total = time.perf_counter() - t0

    rows, prev = [], 0.0
    for r in result.metrics:
        wall = r["elapsed_s"] - prev
        prev = r["elapsed_s"]
        gen, train = r.get("busy/generate", float("nan")), r.get("busy/train", float("nan"))
        rows.append([r["step"], f"{wall:.1f}", f"{gen * wall:.1f}", f"{train * wall:.1f}",
                     f"{r.get('train_ms', float('nan')) / 1e3:.1f}", f"{r.get('step_time_s', float('nan')):.1f}",
                     f"{r.get('gather_ms', 0) + r.get('publish_ms', 0):.0f}",
                     f"{r.get('reward_mean', float('nan')):.3f}", f"{r.get('response_len_mean', float('nan')):.0f}"])
    print_table(["step", "wall s", "generate busy s", "train busy s", "train_ms/1e3", "step_time_s", "gather+publish ms",
                 "reward", "response len"], rows)
    steady = [float(r[1]) for r in rows[1:]] or [float(r[1]) for r in rows]
    figures = {"params_m": round(n_params / 1e6, 1), "batch": args.prompts * args.group,
               "max_new_tokens": args.max_new_tokens, "setup_s": round(result.setup_s, 1),
               "train_s": round(result.train_s, 1), "total_s": round(total, 1), "steps": result.steps,
               "step_s_after_first": round(sum(steady) / len(steady), 1), "rows": rows}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gsm8k_shape_metrics.json").write_text(json.dumps(result.metrics, indent=1))
    print_json_line("gsm8k_shape", figures, baseline=None, ratio=None, target=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
