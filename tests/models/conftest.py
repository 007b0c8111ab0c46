"""The TRL baseline script, loaded as a module, to compare against (skipped where absent)."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest

BASELINE = Path("/work/shared/bench/grpo_trl.py")


@pytest.fixture(scope="session")
def baseline() -> types.ModuleType:
    if not BASELINE.is_file():
        pytest.skip("baseline script /work/shared/bench/grpo_trl.py not present")
    spec = importlib.util.spec_from_file_location("grpo_trl_baseline", BASELINE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
