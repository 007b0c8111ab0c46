"""The hygiene checks count only what the test's own run made, never another run's on the machine."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from tests.runtime.hygiene import ipc_dirs, leftover_ipc_dirs


def test_another_runs_dir_is_not_a_leftover_and_our_own_is(tmp_path: Path) -> None:
    before = ipc_dirs()
    # Another run on the machine (another process) makes its dir meanwhile: same name pattern.
    theirs = Path(f"/tmp/srl-{os.urandom(4).hex()}")
    theirs.mkdir()
    # This process's own run dir (the launcher and the dock make theirs with tempfile.mkdtemp).
    ours = Path(tempfile.mkdtemp(prefix="srl-", dir="/tmp"))
    # A run whose launcher is a child process: its worker specs name its dirs.
    child_run = tmp_path / "run"
    (child_run / "logs").mkdir(parents=True)
    childs = Path(f"/tmp/srl-{os.urandom(4).hex()}")
    childs.mkdir()
    spec = {"scratch_dir": str(childs), "control_endpoint": f"ipc://{childs}/control"}
    (child_run / "logs" / "generate-0.spec.json").write_text(json.dumps(spec))
    try:
        assert leftover_ipc_dirs(before) == {ours}
        assert leftover_ipc_dirs(before, child_run) == {ours, childs}
        shutil.rmtree(ours)
        shutil.rmtree(childs)
        assert leftover_ipc_dirs(before, child_run) == set()
    finally:
        for d in (theirs, ours, childs):
            shutil.rmtree(d, ignore_errors=True)
