"""What `resources.launch: ray` derives from a pipeline without a cluster: process names (the keys
the launcher and the placement share) and each worker process's Ray bundle."""

from __future__ import annotations

from pathlib import Path

from streamrl.config import RayConfig, load_config
from streamrl.runtime.prerun import load_pipeline
from streamrl.runtime.ray_cluster import bundle_for, process_names

REPO = Path(__file__).resolve().parents[2]


def test_process_names_match_the_launchers() -> None:
    pipeline = load_pipeline(load_config(REPO / "configs" / "grpo_digits_colocated.yaml"))
    names = process_names(pipeline)
    # the launcher names a process by its workers in the pipeline's stage order (generate before train)
    assert "generate-0+train-0" in names and "train-0+generate-0" not in names
    assert len(names) == len(set(names)) == len(pipeline.process_groups())


def test_bundles_carry_threads_devices_and_stage_resources() -> None:
    pipeline = load_pipeline(load_config(REPO / "configs" / "grpo_digits.yaml", ["pipeline=../pipelines/grpo.yaml"]))
    generate, train = pipeline.stage("generate"), pipeline.stage("train")
    cfg = RayConfig(stage_resources={"generate": {"node_b": 1}})
    assert bundle_for([generate], "cpu", cfg) == {"CPU": float(generate.threads), "node_b": 1.0}
    assert bundle_for([train], "cuda", cfg) == {"CPU": float(train.threads), "GPU": 1.0}
    assert bundle_for([train], "npu:0", RayConfig()) == {"CPU": float(train.threads), "NPU": 1.0}
    # a colocated process: one bundle for both, the larger thread count
    assert bundle_for([train, generate], "cpu", cfg)["CPU"] == float(max(train.threads, generate.threads))
