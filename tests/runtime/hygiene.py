"""Process and ipc hygiene checks for run tests, without psutil: read /proc directly.

A run started by a test leaves traces that name it: worker processes hold their log file
``<run_dir>/logs/<stage>-<k>.log`` open as stdout/stderr (whether forked from a forkserver or
started with ``python -m streamrl.runtime.worker``), dock servers carry ``--parent-pid <launcher
pid>`` in their argv, and the worker specs record the ipc endpoints (the launcher's
control/weights dir and the dock's dir). Checking those, rather than "any streamrl process on
the machine", keeps the tests right while other runs share the machine.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

# tempfile.mkdtemp(prefix="srl-", dir="/tmp"): "srl-" + 8 random characters
_RUN_IPC_DIR = re.compile(r"^srl-[a-z0-9_]{8}$")


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


def _bound_unix_socket_inodes() -> dict[str, int]:
    """Path -> inode of every bound unix socket on the machine (/proc/net/unix)."""
    out: dict[str, int] = {}
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 8:
            out[parts[7]] = int(parts[6])
    return out


def _my_socket_inodes() -> set[int]:
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def ipc_dirs() -> set[Path]:
    """The run ipc dirs (/tmp/srl-XXXXXXXX) that exist now."""
    return {p for p in Path("/tmp").glob("srl-*") if _RUN_IPC_DIR.match(p.name)}


def leftover_ipc_dirs(before: set[Path]) -> set[Path]:
    """Run ipc dirs created since ``before`` that remain and are not in use by another live run.

    Another agent's run on this machine may create its own dir meanwhile: a dir whose sockets
    are bound by a process other than this one is theirs, not a leftover of ours."""
    bound = _bound_unix_socket_inodes()
    mine = _my_socket_inodes()
    left = set()
    for d in ipc_dirs() - before:
        in_use_by_others = any(
            path.startswith(str(d) + "/") and inode not in mine for path, inode in bound.items()
        )
        if not in_use_by_others and d.exists():
            left.add(d)
    return left


def assert_run_cleaned(run_dir: Path, launcher_pid: int, dirs_before: set[Path], timeout_s: float = 10.0) -> None:
    """No worker or dock process of the run is left, nor any of its ipc dirs."""
    left = wait_gone(run_processes(run_dir, launcher_pid), timeout_s)
    assert not left, f"processes of the run outlived it: {run_processes(run_dir, launcher_pid)}"
    own = {d for d in run_ipc_dirs(run_dir) if d.exists()}
    assert not own, f"ipc dirs of the run remain: {own}"
    stale = leftover_ipc_dirs(dirs_before)
    assert not stale, f"ipc dirs created during the run remain: {stale}"


def only_run_dir(parent: Path) -> Path:
    """The one run dir the launcher made under ``output.run_dir`` (for runs that raised)."""
    dirs = [d for d in parent.iterdir() if d.is_dir()]
    assert len(dirs) == 1, dirs
    return dirs[0]
