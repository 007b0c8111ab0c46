"""streamrl.stages.common: what every stage that builds the policy shares."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from streamrl.config import load_config
from streamrl.runtime.pipeline import read_pipeline
from streamrl.stages.common import build_policy, source_runs_ahead

REPO = Path(__file__).resolve().parents[2]


def test_building_the_policy_sets_the_runs_matmul_precision(tmp_path: Path, matmul_precision_restored: None) -> None:
    cfg = load_config({"pipeline": str(REPO / "pipelines" / "grpo.yaml"), "output": {"run_dir": str(tmp_path)},
                       "model": {"tiny": {"hidden": 32, "layers": 1, "heads": 2, "intermediate": 64},
                                 "matmul_precision": "medium"}})
    model, _ = build_policy(cfg, "cpu", for_training=True)
    assert torch.get_float32_matmul_precision() == "medium"
    assert next(model.parameters()).dtype == torch.float32  # the tensors stay float32
    build_policy(load_config({"pipeline": str(REPO / "pipelines" / "grpo.yaml"),
                              "output": {"run_dir": str(tmp_path)}}), "cpu")
    assert torch.get_float32_matmul_precision() == "highest"


@pytest.mark.parametrize(("pipeline", "overrides", "ahead"), [
    ("grpo_rollout.yaml", [], True),  # the default: the chain's generate link claims one step at a time
    ("grpo.yaml", [], True),  # the generate stage of placement separate
    ("grpo_rollout.yaml", ["algo.dynamic_sampling.enabled=true"], False),  # waves behind the source's gate
    ("grpo_colocated.yaml", [], False),  # a colocated generator claims several steps' prompts
])
def test_the_source_runs_ahead_where_every_step_reader_claims_one_step(
        pipeline: str, overrides: list[str], ahead: bool) -> None:
    """One rule for both sides: the source putting a step's prompts before their version, and each
    generator then claiming one source reserve at a time (streamrl.stages.source, generate)."""
    cfg = load_config(str(REPO / "configs" / "grpo_digits.yaml"), [f"pipeline={REPO / 'pipelines' / pipeline}", *overrides])
    assert source_runs_ahead(cfg, read_pipeline(cfg)) is ahead
    assert source_runs_ahead(cfg, None) is False  # no pipeline to look at (a stage built alone)
