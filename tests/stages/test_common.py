"""streamrl.stages.common: what every stage that builds the policy shares."""

from __future__ import annotations

from pathlib import Path

import torch

from streamrl.config import load_config
from streamrl.stages.common import build_policy

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
