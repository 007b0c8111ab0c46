"""A policy version as one file in the run's shared memory: the same-host path of the policy channel.

Why: over a socket a version's weights are copied into the socket, through the kernel, into the
receiver's message, and only then into the generator's model; the receiving side cannot start
before the last byte arrived. A 10 MB version took about 10-20 ms from ``publish`` to the
generator's hands that way, and a 190 MB one 200-550 ms (``ops/bench/policy_handoff.py``). On
one host the trainer instead writes the version once into a file of the run's shared-memory
scratch directory (``StageContext.shm_dir``, private to the run: mode 0700), and each generator
maps that file: the reply names the file and where each tensor sits in it, and the generator's
tensors are views of its pages.

Format: ``policy-<publisher token>-v<version>.bin``, every tensor's bytes contiguous (row-major),
each starting at a multiple of :data:`ALIGN` bytes; :class:`WeightSlot` says where. Nothing
else is in the file: the reply carries the layout.

Lifetime: a version's file is not changed while a reader may map it. When the next version is out,
the publisher renames the previous version's file to a spare's name (:func:`spare_name`): a
generator that has mapped it keeps reading its pages, and one that has not yet opened it finds it
gone and asks again (it gets the newer version). Once every reader it was named to has said it no
longer maps it (``WeightsRequest.done``), the publisher writes a later version into it instead of
allocating a new file (a fresh file's pages cost as much to zero as to fill, every version);
otherwise it removes it, and the readers' mappings keep the unlinked file alive until they go. A
file whose bytes were also sent as frames is never rewritten (a zero-copy send may still read it).
The readers map it copy-on-write, so a stray write into a received tensor changes that process's
copy only.

The reader checks every name, dtype, shape and offset against the file before it maps anything
(:func:`map_snapshot`), the same rule as every reply on a socket: bytes from elsewhere are decoded,
not trusted.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
from collections.abc import Mapping
from pathlib import Path

import msgspec
import torch

from streamrl.dock.codec import dtype_name, dtype_of

ALIGN = 64  # bytes: each tensor starts on a cache line, which every dtype's alignment divides
DIRECTORY = "policy"  # under the run's shm scratch directory
_NAME = re.compile(r"policy-[0-9a-f]{16}-v[0-9]{1,12}\.bin")


class WeightSlot(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """Where one tensor of a policy file sits: ``offset`` bytes from the start, ``shape``, ``dtype``
    (the dock codec's names: ``float32``, ``bfloat16``, ...)."""

    name: str
    dtype: str
    shape: list[int]
    offset: int


class PolicyFileError(ValueError):
    """A reply's policy file cannot be used as described (missing, or a layout that does not fit it)."""


def new_token() -> str:
    """A publisher's part of its files' names: two publishers of one directory never collide."""
    return secrets.token_hex(8)


def file_name(token: str, version: int) -> str:
    return f"policy-{token}-v{version}.bin"


def spare_name(token: str, n: int) -> str:
    """A file allocated ahead for a version to come; never named in a reply (not a :func:`file_name`)."""
    return f"policy-{token}-next{n}.bin"


def layout(state: Mapping[str, torch.Tensor]) -> tuple[int, list[WeightSlot]]:
    """The size in bytes and the slots of ``state``'s file."""
    slots: list[WeightSlot] = []
    size = 0
    for key, t in state.items():
        slots.append(WeightSlot(key, dtype_name(t.dtype), list(t.shape), size))
        size += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return size, slots


def allocate(directory: Path, name: str, size: int, *, populate: bool = False) -> mmap.mmap:
    """A new file ``directory/name`` of ``size`` bytes, its memory allocated, mapped shared and
    writable. ``populate``: its pages mapped now too (the zeroing of fresh pages is most of a
    first write's time: a spare made ahead of the next version takes it off the publish).

    Raises ``OSError`` where the directory cannot hold it (a container's small /dev/shm): the
    allocation fails here, where a write into a file that tmpfs cannot back would kill the
    process with SIGBUS; and ``FileNotFoundError`` where ``directory`` is gone. It is never made
    here: a run's directories are removed while its last workers stop (runtime/orphans.py), and a
    file written after that would make them again, with no owner to remove them."""
    fd = os.open(directory / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, max(size, 1))  # mmap refuses an empty file
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, max(size, 1))
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        return mmap.mmap(fd, max(size, 1), flags=flags)
    except BaseException:
        os.unlink(directory / name)
        raise
    finally:
        os.close(fd)  # the mapping keeps the file open


def write_snapshot(directory: Path, name: str, state: Mapping[str, torch.Tensor],
                   spare: tuple[str, int, mmap.mmap] | None = None
                   ) -> tuple[int, list[WeightSlot], dict[str, torch.Tensor], mmap.mmap]:
    """Write ``state`` into the file ``directory/name``: a new one, or ``spare`` (name, size,
    mapping: an :func:`allocate` d file of the same size, or a retired version's that no reader
    maps) renamed; returns its size, its slots, the written tensors as views of the writer's
    mapping (the same bytes, to serve over a socket) and that mapping."""
    size, slots = layout(state)
    if spare is not None and spare[1] == size:
        os.rename(directory / spare[0], directory / name)
        mapped = spare[2]
    else:
        if spare is not None:
            remove(directory, spare[0])
        mapped = allocate(directory, name, size)
    views = _views(torch.frombuffer(mapped, dtype=torch.uint8), slots)
    for key, t in state.items():
        views[key].copy_(t.detach())  # from any device; a non-contiguous tensor lands contiguous
    return size, slots, views, mapped


def retire(directory: Path, name: str, spare: str) -> bool:
    """Rename the file ``name`` to the spare name ``spare``: no reader opens it by its version's
    name from now on. False where it is gone already."""
    try:
        os.rename(directory / name, directory / spare)
    except FileNotFoundError:
        return False
    return True


def map_snapshot(directory: Path, name: str, size: int, slots: list[WeightSlot]) -> dict[str, torch.Tensor]:
    """The tensors of the policy file ``directory/name`` as views of a copy-on-write mapping.

    Raises :class:`PolicyFileError` for a name that is not a policy file's, a file that is gone
    or of another size, or a slot that does not fit it."""
    return map_file(directory, name, size, slots)[0]


def map_file(directory: Path, name: str, size: int, slots: list[WeightSlot]
             ) -> tuple[dict[str, torch.Tensor], mmap.mmap]:
    """:func:`map_snapshot`, and the mapping itself: the views hold it (one reference, from
    their storage), so it is unmapped once the last view is gone, which a weak reference to it
    tells."""
    if not _NAME.fullmatch(name):
        raise PolicyFileError(f"{name!r} is not a policy file's name")
    if size < 0:
        raise PolicyFileError(f"a policy file of {size} bytes")
    seen: set[str] = set()
    for s in slots:
        dtype = dtype_of(s.dtype)
        if dtype is None:
            raise PolicyFileError(f"slot {s.name!r}: unknown dtype {s.dtype!r}")
        if s.name in seen:
            raise PolicyFileError(f"slot {s.name!r} appears twice")
        seen.add(s.name)
        if any(d < 0 for d in s.shape) or s.offset < 0 or s.offset % ALIGN:
            raise PolicyFileError(f"slot {s.name!r}: shape {s.shape} at offset {s.offset} is not a valid slot")
        if s.offset + _numel(s.shape) * dtype.itemsize > size:
            raise PolicyFileError(f"slot {s.name!r} ends past the file's {size} bytes")
    try:
        fd = os.open(directory / name, os.O_RDONLY)
    except OSError as exc:  # replaced already (ask again), or another host's file
        raise PolicyFileError(f"cannot open policy file {name}: {exc.strerror}") from None
    try:
        found = os.fstat(fd).st_size
        if found != max(size, 1):
            raise PolicyFileError(f"policy file {name} has {found} bytes, the reply says {size}")
        mapped = mmap.mmap(fd, found, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return _views(torch.frombuffer(mapped, dtype=torch.uint8), slots), mapped


def remove(directory: Path, name: str) -> None:
    (directory / name).unlink(missing_ok=True)


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _views(buffer: torch.Tensor, slots: list[WeightSlot]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for s in slots:
        dtype = dtype_of(s.dtype)
        assert dtype is not None
        nbytes = _numel(s.shape) * dtype.itemsize
        out[s.name] = buffer[s.offset : s.offset + nbytes].view(dtype).view(s.shape)
    return out
