"""Fixtures shared by several test packages: expensive runs that more than one test compares with."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from streamrl.runtime.launcher import RunResult

REPO = Path(__file__).resolve().parents[1]

# Bytecode caching for the session and every interpreter it starts (dock servers, CLI runs, the
# workers' forkservers, Ray's workers: several hundred). Where PYTHONDONTWRITEBYTECODE is set (as on
# the 2-core test machine) each of them compiled the sources of streamrl and of the tests it imports
# again, about a tenth of the suite's CPU time. The caches go to the __pycache__ directories that
# .gitignore names.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
SINGLE_BUDGET = 200  # steps; the run reaches stop_reward 0.9 at step 47-68 on this machine


@pytest.fixture(scope="session")
def single_trainer_digits(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    """configs/grpo_digits.yaml as shipped (one trainer, separate placement, stop_reward 0.9) with at most
    ``SINGLE_BUDGET`` steps, quiet and without TensorBoard or plot: the single-process run that the other
    placements are compared with (tests/e2e/test_data_parallel.py, tests/runtime/test_colocated.py).

    One run for the session: it is synchronous and seeded, so every test would get the same steps
    (version 0 and the generators' seeds make its first step the same samples in any placement)."""
    import streamrl

    run_dir = tmp_path_factory.mktemp("single_trainer_digits")
    return streamrl.run(REPO / "configs" / "grpo_digits.yaml", [
        f"output.run_dir={run_dir}", "output.progress=none", "output.tensorboard=false", "output.plot=false",
        f"algo.steps={SINGLE_BUDGET}"])


@pytest.fixture
def matmul_precision_restored() -> Iterator[None]:
    """The process's float32 matmul precision (model.matmul_precision) set back to highest after the
    test, whatever the test set it to."""
    from streamrl.models.matmul_precision import apply

    try:
        yield
    finally:
        apply("highest")


@pytest.fixture
def medium_matmuls(matmul_precision_restored: None) -> None:
    """The test runs under model.matmul_precision medium (highest again after it)."""
    from streamrl.models.matmul_precision import apply

    apply("medium")
