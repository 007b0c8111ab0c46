"""Every test under tests/tasks runs with the Hugging Face hub offline and an empty cache.

``datasets`` and ``huggingface_hub`` read HF_HUB_OFFLINE / HF_DATASETS_OFFLINE and the cache paths
once, at import: an env var set by a test after another test imported them changes nothing, and a
hub lookup would then go to the network (and wait out its retries where there is none). So the
constants of already-imported modules are set too; a later import reads the env vars.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _hub_offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(cache))
    hub = sys.modules.get("huggingface_hub.constants")
    if hub is not None:
        monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
        monkeypatch.setattr(hub, "HF_HUB_CACHE", str(cache / "hub"))
    config = sys.modules.get("datasets.config")
    if config is not None:
        monkeypatch.setattr(config, "HF_HUB_OFFLINE", True)
        monkeypatch.setattr(config, "HF_DATASETS_OFFLINE", True)
        monkeypatch.setattr(config, "HF_DATASETS_CACHE", cache / "datasets")
