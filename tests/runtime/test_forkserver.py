"""The workers' OpenMP waits (runtime/forkserver.py): a short spin unless the user chose theirs."""

from __future__ import annotations

import subprocess
import sys

from streamrl.runtime.forkserver import SPIN_COUNT, openmp_waits


def test_workers_spin_a_short_while_by_default() -> None:
    assert openmp_waits({}) == {"GOMP_SPINCOUNT": SPIN_COUNT}
    assert openmp_waits({"PATH": "/bin"}) == {"GOMP_SPINCOUNT": SPIN_COUNT}


def test_the_users_own_setting_wins() -> None:
    assert openmp_waits({"OMP_WAIT_POLICY": "PASSIVE"}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert openmp_waits({"GOMP_SPINCOUNT": "0"}) == {"GOMP_SPINCOUNT": "0"}
    both = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "1000"}
    assert openmp_waits(both) == both


def test_importing_the_forkserver_sets_them_for_the_workers() -> None:
    """Set at import, before anything loads OpenMP: the forkserver and every worker it forks inherit it."""
    code = "import os, streamrl.runtime.forkserver; print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))"
    env = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env, check=True)
    assert out.stdout.split() == [SPIN_COUNT, "None"]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**env, "OMP_WAIT_POLICY": "PASSIVE"}, check=True)
    assert out.stdout.split() == ["None", "PASSIVE"]
