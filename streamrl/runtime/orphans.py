"""A launcher's private directories, and what happens to them and its processes when it is killed.

A launcher keeps its ipc endpoints and scratch files in short private directories
(``/tmp/srl-XXXXXXXX``, and ``/dev/shm/srl-XXXXXXXX`` where there is a ``/dev/shm``). It removes
them when it ends; a launcher that is killed cannot. So each directory holds an owner file with
the launcher's pid (:func:`make_private_dir`, :func:`claim_dir`), and whoever outlives the launcher
removes the directories of a dead owner:

- its workers, as they exit once it is gone (:func:`remove_if_owner_is`: only the directories
  whose owner is the launcher they watched, so a worker whose parent is a Ray host actor leaves
  the driver's directories alone);
- any later run, at start-up (:func:`remove_dead_owners`): only directories whose owner pid no
  longer runs, never another live run's. A directory without an owner file (one made by an older
  streamrl, or by anything else) is never touched.

:func:`wait_gone` is how a worker learns that its launcher is gone, at once on Linux (a pidfd).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

import anyio

log = logging.getLogger("streamrl.orphans")

SHM_DIR = "/dev/shm"  # a tmpfs on Linux: files there are memory, not disk
OWNER_FILE = "owner.pid"  # in each private directory: the pid of the launcher that made it
_PRIVATE = re.compile(r"^srl-[a-z0-9_]{8}$")  # tempfile.mkdtemp(prefix="srl-"): 8 random characters
POLL_S = 0.2  # without a pidfd (not Linux): how often a worker checks that its launcher runs


def process_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return True  # no /proc (not Linux): existence is all we can tell


def _bases() -> list[Path]:
    return [Path("/tmp"), Path(SHM_DIR)]  # where launchers make them (socket paths must stay short)


def make_private_dir(base: str) -> str:
    """A new private directory under ``base``, owned by this process (its owner file)."""
    d = tempfile.mkdtemp(prefix="srl-", dir=base)
    claim_dir(d)
    return d


def claim_dir(d: str) -> None:
    """Record this process as the owner of the private directory ``d`` (e.g. the dock's)."""
    (Path(d) / OWNER_FILE).write_text(f"{os.getpid()}\n")


def owner(d: Path) -> int | None:
    """The pid in ``d``'s owner file; None for a directory that is not a launcher's private one."""
    if d.parent not in _bases() or not _PRIVATE.match(d.name):
        return None
    try:
        st = d.lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():  # a link, or another user's: not ours
            return None
        return int((d / OWNER_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


def remove_private_dir(d: Path) -> None:
    """Remove the private directory ``d`` even while the run's other processes still use it.

    The run's other workers stop at about the same moment, and one may still write into ``d`` by
    its path (a trainer publishing its last version). A file landing in it during a plain
    ``rmtree`` would leave the directory behind, its owner file possibly gone, so that no one
    would ever remove it. So ``d`` is first renamed (atomically) to a fresh private name beside
    it: a write by the old path then fails instead of landing. The owner file goes last, so a
    removal cut short leaves a directory that the next run's :func:`remove_dead_owners` still
    recognises."""
    target = d
    with contextlib.suppress(OSError):
        fresh = Path(tempfile.mkdtemp(prefix="srl-", dir=d.parent))
        try:
            os.rename(d, fresh)  # onto the empty fresh directory: rename(2) replaces it
            target = fresh
        except OSError:  # d is already gone (another worker's removal), or not renameable
            fresh.rmdir()
    with contextlib.suppress(OSError):
        for entry in target.iterdir():
            if entry.name == OWNER_FILE:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        (target / OWNER_FILE).unlink(missing_ok=True)
        target.rmdir()


def remove_if_owner_is(dirs: list[str], pid: int) -> list[str]:
    """Remove those of ``dirs`` that launcher ``pid`` (gone) owned; returns what was removed."""
    removed = []
    for d in dict.fromkeys(dirs):  # scratch and shm are one directory where there is no /dev/shm
        if d and owner(Path(d)) == pid:
            remove_private_dir(Path(d))
            removed.append(d)
    return removed


def remove_dead_owners() -> list[Path]:
    """Remove every private directory whose owner launcher no longer runs (killed, so it could not
    remove them itself, and none of its workers outlived it to do so)."""
    removed = []
    for base in _bases():
        with contextlib.suppress(OSError):
            for d in base.iterdir():
                pid = owner(d)
                if pid is not None and pid != os.getpid() and not process_alive(pid):
                    remove_private_dir(d)
                    removed.append(d)
    if removed:
        log.info("removed the private directories of launchers that were killed: %s", removed)
    return removed


async def wait_gone(pid: int) -> None:
    """Return once process ``pid`` has ended (a zombie counts as ended). On Linux a pidfd turns
    readable the moment the process exits: no polling delay, and no confusion with a later process
    that reuses the pid."""
    wait_readable = getattr(anyio, "wait_readable", None)  # anyio >= 4.7
    fd: int | None = None
    if wait_readable is not None and hasattr(os, "pidfd_open"):
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return
        except OSError:  # an old kernel, or a sandbox without pidfds: poll
            fd = None
    if fd is not None:
        try:
            await wait_readable(fd)
        finally:
            os.close(fd)
        return
    while process_alive(pid):
        await anyio.sleep(POLL_S)
