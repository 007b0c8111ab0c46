"""Process and ipc hygiene checks for run tests, without psutil: read /proc directly.

A run started by a test leaves traces that name it: worker processes hold their log file
``<run_dir>/logs/<stage>-<k>.log`` open as stdout/stderr (whether forked from a forkserver or
started with ``python -m streamrl.runtime.worker``), dock servers carry ``--parent-pid <launcher
pid>`` in their argv, and the worker specs record the ipc endpoints (the launcher's
control/weights dir and the dock's dir). Checking those, rather than "any streamrl process on
the machine", keeps the tests right while other runs share the machine.

Run directories (``/tmp/srl-*``, ``/dev/shm/srl-*``) are counted as a test's own only when this
process made them (an in-process launcher or dock: every ``tempfile.mkdtemp`` here is recorded
from import on) or a run directory's worker specs name them (a launcher in a child process). A
``srl-`` dir that appeared meanwhile for any other reason belongs to another run on the machine:
"new since the test started" was not enough (5 failures in a full run beside another run).
"""

from __future__ import annotations

import functools
import json
import multiprocessing.process
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

# tempfile.mkdtemp(prefix="srl-", dir="/tmp"): "srl-" + 8 random characters
_RUN_IPC_DIR = re.compile(r"^srl-[a-z0-9_]{8}$")


#: Every directory ``tempfile.mkdtemp`` made in this process since this module was imported.
_MADE_HERE: set[Path] = set()


def _record_mkdtemp() -> None:
    """Wrap ``tempfile.mkdtemp`` so this process's own run dirs are known (the launcher and the dock
    call it as ``tempfile.mkdtemp``, so they get the wrapper). Idempotent."""
    original = tempfile.mkdtemp
    if getattr(original, "_records_for_hygiene", False):
        return

    @functools.wraps(original)
    def mkdtemp(*args: Any, **kwargs: Any) -> str:
        made = original(*args, **kwargs)
        _MADE_HERE.add(Path(made))
        return made

    mkdtemp._records_for_hygiene = True  # type: ignore[attr-defined]
    tempfile.mkdtemp = mkdtemp  # type: ignore[assignment]


_record_mkdtemp()


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace")


def _state_and_ppid(pid: int) -> tuple[str, int] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ')'
    fields = stat.rsplit(")", 1)[1].split()
    return fields[0], int(fields[1])


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _live_others() -> list[int]:
    """Every running process but this one (zombies count as gone)."""
    me = os.getpid()
    return [pid for pid in _pids()
            if pid != me and (st := _state_and_ppid(pid)) is not None and st[0] not in ("Z", "X")]


def live_processes(*needles: str) -> dict[int, str]:
    """Processes (not zombies) whose command line contains any of ``needles``: pid -> cmdline."""
    cmds = {pid: _cmdline(pid) for pid in _live_others()}
    return {pid: cmd for pid, cmd in cmds.items() if any(n in cmd for n in needles)}


def processes_with_environ(text: str) -> dict[int, str]:
    """Live processes (not this one) whose environment holds ``text`` (e.g. a run's scratch dir,
    which a vLLM engine core inherits as VLLM_RPC_BASE_PATH): pid -> cmdline. Unlike a command-line
    match, this tells one run's processes from another's running beside it."""
    needle = text.encode()
    found: dict[int, str] = {}
    for pid in _live_others():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if needle in environ:
            found[pid] = _cmdline(pid)
    return found


def descendants(root: int) -> dict[int, str]:
    """Live descendants of ``root`` (children, grandchildren, ...): pid -> cmdline."""
    parent_of: dict[int, int] = {}
    for pid in _pids():
        st = _state_and_ppid(pid)
        if st is not None and st[0] not in ("Z", "X"):
            parent_of[pid] = st[1]
    found: dict[int, str] = {}
    frontier = {root}
    while frontier:
        frontier = {pid for pid, ppid in parent_of.items() if ppid in frontier and pid not in found}
        for pid in frontier:
            found[pid] = _cmdline(pid)
    return found


def processes_with_files_under(directory: Path) -> dict[int, str]:
    """Live processes (not this one) holding a file under ``directory`` open: pid -> cmdline."""
    prefix = str(directory.resolve()) + "/"
    found: dict[int, str] = {}
    for pid in _live_others():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(prefix):
                found[pid] = _cmdline(pid)
                break
    return found


def run_processes(run_dir: Path, launcher_pid: int) -> dict[int, str]:
    """Every process that belongs to the run: its workers (they hold their log in the run dir
    open) and its dock servers (``--parent-pid <launcher>``)."""
    return {**processes_with_files_under(run_dir), **live_processes(f"--parent-pid {launcher_pid} ")}


def wait_gone(pids: list[int] | dict[int, str], timeout_s: float = 10.0) -> list[int]:
    """Wait until these processes are gone (or zombies); returns those still alive."""
    deadline = time.monotonic() + timeout_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if (st := _state_and_ppid(p)) is not None and st[0] not in ("Z", "X")]
        if alive:
            time.sleep(0.1)
    return alive


def run_ipc_dirs(run_dir: Path) -> set[Path]:
    """The ipc and scratch directories a processes-mode run used, from its worker specs (the
    endpoints, and the run's private disk and shared-memory directories)."""
    dirs: set[Path] = set()
    for spec in (run_dir / "logs").glob("*.spec.json"):
        data = json.loads(spec.read_text())
        dirs.update(Path(data[key]) for key in ("scratch_dir", "shm_dir") if data.get(key))
        for key in ("dock_endpoint", "control_endpoint", "weights_endpoint"):
            endpoint = data.get(key, "")
            if endpoint.startswith("ipc://"):
                dirs.add(Path(endpoint[len("ipc://"):]).parent)
    return dirs


def ipc_dirs() -> set[Path]:
    """The run dirs (/tmp/srl-XXXXXXXX, /dev/shm/srl-XXXXXXXX) that exist now, whoever made them."""
    return {p for root in ("/tmp", "/dev/shm") for p in Path(root).glob("srl-*") if _RUN_IPC_DIR.match(p.name)}


def own_run_dirs(*run_dirs: Path) -> set[Path]:
    """The ``srl-`` dirs that are this test's: made in this process, or named by the worker specs
    of ``run_dirs`` (runs whose launcher is a child process). Not this process's multiprocessing
    temporary directory (the forkserver's socket, streamrl.runtime.forkserver.use_private_temp_dir):
    it outlives every run, until the process exits."""
    process_own = multiprocessing.process.current_process()._config.get("tempdir")
    own = {d for d in _MADE_HERE if _RUN_IPC_DIR.match(d.name) and str(d) != process_own}
    for run_dir in run_dirs:
        own |= run_ipc_dirs(run_dir)
    return own


def leftover_ipc_dirs(before: set[Path], *run_dirs: Path) -> set[Path]:
    """This test's run dirs (see :func:`own_run_dirs`) not there at ``before`` that still exist.

    Only its own: another run on this machine makes ``srl-`` dirs of its own meanwhile, and
    those are not a leftover of this one, however they look."""
    return {d for d in own_run_dirs(*run_dirs) - before if d.exists()}


def assert_run_cleaned(run_dir: Path, launcher_pid: int, dirs_before: set[Path], timeout_s: float = 10.0) -> None:
    """No worker or dock process of the run is left, nor any of its ipc dirs."""
    left = wait_gone(run_processes(run_dir, launcher_pid), timeout_s)
    assert not left, f"processes of the run outlived it: {run_processes(run_dir, launcher_pid)}"
    own = {d for d in run_ipc_dirs(run_dir) if d.exists()}
    assert not own, f"ipc dirs of the run remain: {own}"
    stale = leftover_ipc_dirs(dirs_before, run_dir)
    assert not stale, f"ipc dirs created during the run remain: {stale}"


def only_run_dir(parent: Path) -> Path:
    """The one run dir the launcher made under ``output.run_dir`` (for runs that raised)."""
    dirs = [d for d in parent.iterdir() if d.is_dir()]
    assert len(dirs) == 1, dirs
    return dirs[0]
