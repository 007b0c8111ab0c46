"""Fixtures shared by several test packages: expensive runs that more than one test compares with."""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import sys
import threading
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
# After the session, seconds the interpreter gets to exit. Exit waits for every non-daemon thread and
# joins every multiprocessing child still running, with no timeout: a test that left one would keep
# CI waiting until its time limit, with nothing in the log to say why.
EXIT_WATCHDOG_S = 120.0


def pytest_unconfigure(config: pytest.Config) -> None:
    """The last hook before the interpreter exits: name what the tests left running, stop the
    children, and make sure a thread that never ends fails the session instead of hanging it."""
    threads = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    children = multiprocessing.active_children()
    for what in [*(f"thread {t.name!r}" for t in threads), *(f"process {c.name!r} (pid {c.pid})" for c in children)]:
        print(f"tests left running at exit: {what}", file=sys.__stderr__)
    for child in children:
        child.terminate()
        child.join(5)
        if child.is_alive():
            child.kill()
            child.join(5)
    # if exit is still waiting then: every thread's stack to stderr, and exit status 1
    faulthandler.dump_traceback_later(EXIT_WATCHDOG_S, exit=True, file=sys.__stderr__)


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
