"""Day one, end to end in real processes: a Hugging Face checkpoint (Qwen2 architecture, a BPE
tokenizer with a chat template) loaded through ``model.path``, a GSM8K-format Parquet dataset,
the math-verify reward, a cosine schedule over ``algo.epochs``, held-out evaluation, and
``streamrl report`` on the run. Nothing is downloaded: the checkpoint and the files are made here."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import yaml

import streamrl
from streamrl.cli import main as cli_main
from streamrl.config import load_config
from tests.e2e.hf_checkpoint import gsm8k_rows, save_qwen2_checkpoint, write_gsm8k_parquet
from tests.runtime.hygiene import assert_run_cleaned, ipc_dirs

REPO = Path(__file__).resolve().parents[2]
TRAIN_ROWS, EVAL_ROWS, PROMPTS_PER_STEP = 64, 16, 8
LR, WARMUP, MIN_RATIO = 1e-3, 1, 0.1


def recipe(tmp_path: Path) -> dict:
    model = save_qwen2_checkpoint(tmp_path / "model")
    train = write_gsm8k_parquet(tmp_path / "data" / "train.parquet", gsm8k_rows(TRAIN_ROWS, seed=1))
    test = write_gsm8k_parquet(tmp_path / "data" / "test.parquet", gsm8k_rows(EVAL_ROWS, seed=2))
    return {
        "pipeline": str(REPO / "pipelines" / "grpo.yaml"),
        "model": {"path": str(model)},
        "task": {"name": "dataset", "chat_template": True,
                 "system_prompt": "Please reason step by step, and put your final answer within \\boxed{}.",
                 "options": {"path": str(train), "eval_path": str(test), "prompt_field": "question",
                             "answer_field": "answer", "reward": {"math": 1.0, "format": 0.1}}},
        "algo": {"epochs": 0.5, "prompts_per_step": PROMPTS_PER_STEP, "group_size": 4, "max_new_tokens": 12,
                 "lr": LR, "lr_schedule": "cosine", "warmup_steps": WARMUP, "min_lr_ratio": MIN_RATIO},
        "eval": {"every": 2, "max_prompts": 8},
        "output": {"run_dir": str(tmp_path / "runs"), "name": "gsm8k", "progress": "none"},
    }


def cosine_lr(step_index: int, total: int) -> float:
    """transformers' cosine_with_min_lr with linear warmup, at optimizer step ``step_index`` (0-based)."""
    if step_index < WARMUP:
        return LR * step_index / WARMUP
    progress = (step_index - WARMUP) / (total - WARMUP)
    return LR * (MIN_RATIO + (1 - MIN_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))


@pytest.mark.timeout(300)
def test_hf_checkpoint_on_gsm8k_parquet_with_math_reward_eval_schedule_and_report(tmp_path: Path) -> None:
    before = ipc_dirs()
    result = streamrl.run(recipe(tmp_path))
    steps = math.ceil(0.5 * TRAIN_ROWS / PROMPTS_PER_STEP)  # algo.epochs over the train split
    assert result.steps == steps and result.stop_reason == f"completed {steps} steps"
    run_dir = result.run_dir

    # training rows: the weighted reward and its parts, and the lr the cosine schedule gives each step
    for i, row in enumerate(result.metrics):
        assert row["step"] == i + 1
        assert 0.0 <= row["score/math_mean"] <= 1.0 and 0.0 <= row["score/format_mean"] <= 1.0
        assert row["reward_mean"] == pytest.approx(row["score/math_mean"] + 0.1 * row["score/format_mean"], abs=1e-6)
        assert row["lr"] == pytest.approx(cosine_lr(i, steps), rel=1e-6, abs=1e-12), (i, row["lr"])
        assert row["response_len_mean"] > 0

    # held-out evaluation of versions 2 and 4 (the last, at the end) on the test split
    assert sorted(r["step"] for r in result.eval_metrics) == [2, 4]
    for r in result.eval_metrics:
        assert r["eval/prompts"] == 8 and 0.0 <= r["eval/pass@1"] <= 1.0
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == steps + 2

    # the resolved config (algo.epochs became algo.steps) loads again as is
    saved = load_config(yaml.safe_load((run_dir / "config.yaml").read_text()))
    assert saved.algo.steps == steps and saved.algo.epochs is None

    # the final policy is a transformers checkpoint that holds the trained version
    assert json.loads((run_dir / "checkpoint" / "streamrl_state.json").read_text()) == {"policy_version": steps}

    # streamrl report: PNGs that are real pictures, and a summary page naming the run
    assert cli_main(["report", str(run_dir)]) == 0
    report = run_dir / "report"
    index = (report / "index.html").read_text()
    assert run_dir.name in index
    pngs = {p.name for p in report.glob("*.png")}
    assert {"reward.png", "eval.png", "response_length.png"} <= pngs, pngs
    import matplotlib.image

    for name in pngs:
        pixels = matplotlib.image.imread(report / name)
        assert pixels.shape[0] > 100 and pixels.shape[1] > 100 and float(pixels.std()) > 0.01, name
    assert_run_cleaned(run_dir, os.getpid(), before)


def test_the_shipped_recipe_validates_with_the_files_in_place(tmp_path: Path) -> None:
    """configs/grpo_qwen2.5_0.5b_gsm8k.yaml as a user runs it, with a stand-in checkpoint and the
    GSM8K files where its README section says to put them (run from tmp_path)."""
    save_qwen2_checkpoint(tmp_path / "models" / "Qwen2.5-0.5B-Instruct")
    write_gsm8k_parquet(tmp_path / "data/gsm8k/main/train-00000-of-00001.parquet", gsm8k_rows(400, seed=1))
    write_gsm8k_parquet(tmp_path / "data/gsm8k/main/test-00000-of-00001.parquet", gsm8k_rows(10, seed=2))
    cwd = os.getcwd()
    os.chdir(tmp_path)  # the recipe's paths resolve against the config's directory, then the cwd
    try:
        assert cli_main(["validate", str(REPO / "configs" / "grpo_qwen2.5_0.5b_gsm8k.yaml")]) == 0
        cfg = load_config(REPO / "configs" / "grpo_qwen2.5_0.5b_gsm8k.yaml")
        from streamrl.runtime.prerun import load_pipeline, resolve_run_length

        resolved = resolve_run_length(cfg)
        assert resolved.algo.steps == math.ceil(400 / 32)  # one epoch of 400 rows at 32 prompts per step
        assert [s.name for s in load_pipeline(resolved).stages][-1] == "eval"
    finally:
        os.chdir(cwd)


def test_a_tokenizer_without_pad_pads_with_eos_and_one_without_eos_is_refused() -> None:
    """Many base models' tokenizers define no pad token; generation needs EOS to stop."""
    from streamrl.stages.common import TokenizerTokensError, with_pad_token
    from tests.e2e.hf_checkpoint import train_tokenizer

    tok = train_tokenizer(["What is 1 + 1?"])
    tok.pad_token = None
    assert tok.pad_token_id is None
    assert with_pad_token(tok).pad_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    tok.eos_token = None
    with pytest.raises(TokenizerTokensError, match="defines no eos token"):
        with_pad_token(tok)
