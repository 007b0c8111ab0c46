"""The TRL baseline script, loaded as a module, to compare against (skipped where absent)."""

from __future__ import annotations

import importlib.util
import os
import types
from pathlib import Path

import pytest

# The reference baseline script is not part of the repository: STREAMRL_TRL_BASELINE names it where
# a machine has it (the tests that compare against it skip elsewhere).
_BASELINE_ENV = os.environ.get("STREAMRL_TRL_BASELINE")
BASELINE = Path(_BASELINE_ENV) if _BASELINE_ENV else None


@pytest.fixture(scope="session")
def baseline() -> types.ModuleType:
    if BASELINE is None or not BASELINE.is_file():
        pytest.skip("set STREAMRL_TRL_BASELINE to the reference TRL baseline script (grpo_trl.py) to compare")
    spec = importlib.util.spec_from_file_location("grpo_trl_baseline", BASELINE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
