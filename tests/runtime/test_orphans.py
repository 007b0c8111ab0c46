"""The launcher killed with SIGKILL while a worker is stuck in a blocking call in a thread.

Every child watches the launcher's pid; a worker cancels itself when it is gone, but a blocking
call in a worker thread (a collective waiting for a peer, a stage's own ``run_sync``) survives the
cancellation. The worker then exits hard after ``ORPHAN_EXIT_S`` instead of living on for the
call's own timeout (600 s for a collective; an hour here).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from streamrl.runtime.orphans import owner, remove_dead_owners
from streamrl.runtime.worker import ORPHAN_EXIT_S
from tests.runtime.hygiene import descendants, run_ipc_dirs, wait_gone
from tests.runtime.user_stages import grpo_with_stage

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(180)
def test_a_worker_blocked_in_a_thread_exits_once_the_launcher_is_killed(tmp_path: Path) -> None:
    pipe = grpo_with_stage(tmp_path, "score", "tests.runtime.user_stages:BlocksInAThread")
    runs = tmp_path / "runs"
    own_tmp = tmp_path / "tmp"  # the launcher's TMPDIR: what multiprocessing would leave lands here
    own_tmp.mkdir()
    started: dict[int, str] = {}
    with (tmp_path / "out.txt").open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "streamrl.cli", "run", str(REPO / "configs" / "grpo_digits.yaml"),
             f"pipeline={pipe}", f"output.run_dir={runs}", "output.progress=none",
             "resources.exit_grace_s=2"],  # the blocked worker's orphan timer: 2 s, not 10
            stdout=sink, stderr=subprocess.STDOUT, cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(own_tmp)}, start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and not list(runs.glob("*/blocked")):
            time.sleep(0.2)
        assert list(runs.glob("*/blocked")), (tmp_path / "out.txt").read_text()
        started.update(descendants(proc.pid))
        assert len(started) >= 7, started
        # the forkserver's socket is in a private directory of the launcher's (not multiprocessing's
        # own /tmp/pymp-*, which has no owner to tell whose it is)
        forkserver_dirs = [d for d in Path("/tmp").glob("srl-*") if owner(d) == proc.pid
                           and any(f.name.startswith("listener-") for f in d.iterdir())]
        assert forkserver_dirs
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        left = wait_gone(started, ORPHAN_EXIT_S + 15)
        assert not left, {p: started[p] for p in left}
        # the next run's start-up sweep removes it (here; or another run's on this machine did already)
        assert not list(own_tmp.glob("pymp-*"))
        remove_dead_owners()
        assert not [d for d in forkserver_dirs if d.exists()]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        for pid in wait_gone(started, 0.5):  # whatever the test left alive, it stops
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        # a SIGKILLed launcher cannot remove its ipc / scratch dirs; its workers do as they stop
        # (tests/e2e/test_resume.py checks that): whatever is left here, the test removes
        for run_dir in runs.glob("*"):
            for d in run_ipc_dirs(run_dir):
                shutil.rmtree(d, ignore_errors=True)
    log = next(runs.glob("*/logs/score-0.log")).read_text()
    assert "did not stop within" in log and "exiting" in log


def test_start_up_removes_the_private_dirs_of_dead_launchers_only() -> None:
    """What a run's start-up sweeps (runtime/orphans.py): a private dir whose owner launcher has
    exited goes; one whose owner runs (here: this process) stays, and so does one without an owner
    file (made by something else). Only the dirs made here are checked."""
    import tempfile

    from streamrl.runtime.orphans import make_private_dir, remove_dead_owners

    child = subprocess.run([sys.executable, "-c", "from streamrl.runtime.orphans import make_private_dir; "
                            "print(make_private_dir('/tmp'))"], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONPATH": str(REPO)}, check=True)
    dead = Path(child.stdout.strip())
    live = Path(make_private_dir("/tmp"))
    plain = Path(tempfile.mkdtemp(prefix="srl-", dir="/tmp"))
    try:
        assert dead.is_dir()
        assert dead in remove_dead_owners()
        assert not dead.exists() and live.is_dir() and plain.is_dir()
    finally:
        for d in (dead, live, plain):
            shutil.rmtree(d, ignore_errors=True)


def test_a_removed_private_dir_is_not_made_again_by_a_late_write() -> None:
    """A worker removes its dead launcher's directory while another process still writes into it by
    its path: the directory is renamed before it is emptied, so the late write fails instead of
    landing in it (a file landing during a plain rmtree left /dev/shm/srl-* behind, owner file
    gone). Nothing of it is left under its base, under any name."""
    from streamrl.runtime import policy_file
    from streamrl.runtime.orphans import make_private_dir, owner, remove_if_owner_is

    d = Path(make_private_dir("/tmp"))
    try:
        (d / "policy").mkdir()
        (d / "policy" / "v1.bin").write_bytes(b"x")
        before = {p.name for p in Path("/tmp").iterdir()}
        assert remove_if_owner_is([str(d)], os.getpid()) == [str(d)]
        assert not d.exists()
        with pytest.raises(FileNotFoundError):
            policy_file.allocate(d / "policy", "v2.bin", 16)
        assert not d.exists()
        # the fresh name it was renamed to is gone too: no new directory of this process's in /tmp
        assert not [p for p in Path("/tmp").iterdir() if p.name not in before and owner(p) == os.getpid()]
    finally:
        shutil.rmtree(d, ignore_errors=True)
