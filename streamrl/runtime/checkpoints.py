"""Resumable run checkpoints: their layout, the atomic commit, pruning, and what a resume starts from.

A run with ``output.checkpoint_every: N`` saves after every N-th optimizer step (and when it is
stopped with SIGTERM) into its run directory::

    checkpoints/
        step-00000010/             complete: a directory of this name exists only after its commit
            state.json             RunState (below): version, data position, LR schedule, trained samples
            train/                 the policy and AdamW, sharded (torch.distributed.checkpoint)
            rng/train-<rank>.json  each train rank's RNG states (torch CPU/accelerator, Python)
        step-00000012.partial/     being written, or left by a crash: never read, removed by the next save

Atomicity: every file is written inside ``step-N.partial``, flushed to disk (fsync), and only then
is the directory renamed to ``step-N`` (a rename within one directory is atomic) and the parent
directory fsynced. A crash at any moment leaves either the previous complete checkpoint or the
new one; pruning deletes older checkpoints only after the new one is complete.

What is *not* in a checkpoint, and why resuming is still exact:

- The data source's RNG and any task state (a dataset's shuffled order): the source replays its
  prompt stream up to the saved position (``trained_below``) instead; prompts cost microseconds.
- The generate workers' RNG: each micro-batch is sampled with a generator seeded from the run's
  seed and its first sample's key (``sample_key``), so a sample regenerated after a resume draws
  the same tokens it drew before, whichever worker generates it.
- Samples in flight (generated, scored, not yet trained): they are regenerated. ``trained_below``
  and ``trained_extra`` say exactly which sample keys the saved policy has trained on; the source
  skips those and emits every other one again (``docs/reliability.md``).

A sample's key is ``step * batch_size + slot``: its source step and its position among that
step's ``prompts_per_step * group_size`` samples (group-major). Keys do not depend on the dock's
indices, which start again at 0 in every incarnation of the run.
"""

from __future__ import annotations

import base64
import os
import random
import re
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec
import torch

FORMAT = 1
_NAME = re.compile(r"^step-(\d{8})$")
_PARTIAL = re.compile(r"^step-(\d{8})\.partial$")
STATE_FILE = "state.json"


class CheckpointMissing(FileNotFoundError):
    """A resume was asked for, but the run directory holds no complete checkpoint."""


class ResumeMismatch(ValueError):
    """The checkpoint was written by a run whose batch shape differs from this config's."""


class RunState(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``state.json`` of a checkpoint (JSON, no pickle)."""

    format: int = FORMAT
    version: int  # optimizer steps done = the policy version the saved weights are
    batch_size: int  # prompts_per_step * group_size of the saving run (keys depend on it)
    group_size: int
    trained_below: int  # every sample key < this was trained on
    trained_extra: list[int] = msgspec.field(default_factory=list)  # trained keys >= trained_below
    lr_schedule: dict[str, Any] = msgspec.field(default_factory=dict)  # the LR scheduler's state_dict
    train_ranks: int = 1
    saved_at: float = 0.0  # time.time() of the save
    reason: str = "periodic"  # periodic | sigterm | final


class ResumeFrom(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What a resumed run's workers get in their spec: the checkpoint and its state."""

    path: str  # the complete checkpoint directory
    state: RunState


class TrainedKeys:
    """The sample keys trained on so far, kept small: a watermark below which every key is
    trained, plus the trained keys above it (at most a few steps' worth with max_staleness)."""

    def __init__(self, below: int = 0, extra: Iterable[int] = ()) -> None:
        self.below = below
        self.extra: set[int] = {k for k in extra if k >= below}
        self._advance()

    def add(self, keys: Iterable[int]) -> None:
        self.extra.update(k for k in keys if k >= self.below)
        self._advance()

    def add_range(self, start: int, stop: int) -> None:
        """Keys ``start`` .. ``stop - 1`` (a synchronous step: exactly one source step's samples)."""
        if start <= self.below:
            self.below = max(self.below, stop)
            self.extra = {k for k in self.extra if k >= self.below}
            self._advance()
        else:
            self.add(range(start, stop))

    def _advance(self) -> None:
        while self.below in self.extra:
            self.extra.discard(self.below)
            self.below += 1

    def __contains__(self, key: int) -> bool:
        return key < self.below or key in self.extra

    def sorted_extra(self) -> list[int]:
        return sorted(self.extra)


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_name(version: int) -> str:
    return f"step-{version:08d}"


def partial_dir(run_dir: Path, version: int) -> Path:
    return checkpoints_dir(run_dir) / f"{checkpoint_name(version)}.partial"


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (``.partial`` directories are not)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()
             and (p / STATE_FILE).is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def read_state(path: Path) -> RunState:
    try:
        return msgspec.json.decode((path / STATE_FILE).read_bytes(), type=RunState)
    except (OSError, msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise CheckpointMissing(f"{path / STATE_FILE}: not a readable checkpoint state ({exc}); delete {path} to "
                                "resume from the one before it") from None


def resume_from(run_dir: Path, batch_size: int, group_size: int) -> ResumeFrom:
    """The newest complete checkpoint of ``run_dir``, checked against this run's batch shape."""
    path = latest_checkpoint(run_dir)
    if path is None:
        raise CheckpointMissing(
            f"{run_dir} holds no complete checkpoint (checkpoints/step-*/{STATE_FILE}); a run saves them with "
            "output.checkpoint_every: N. Start a fresh run instead: streamrl run CONFIG")
    state = read_state(path)
    if state.format != FORMAT:
        raise ResumeMismatch(f"{path} has checkpoint format {state.format}; this streamrl reads format {FORMAT}")
    if (state.batch_size, state.group_size) != (batch_size, group_size):
        raise ResumeMismatch(
            f"{path} was saved with {state.batch_size} samples per step in groups of {state.group_size}; this config "
            f"has {batch_size} in groups of {group_size}. Resume with the run's own algo.prompts_per_step and "
            "algo.group_size (its config.yaml)")
    return ResumeFrom(path=str(path), state=state)


def fsync_tree(root: Path) -> None:
    """Flush every file under ``root`` and the directories themselves to disk."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            _fsync(Path(dirpath, name))
        _fsync(Path(dirpath))


def _fsync(path: Path) -> None:
    """Flush one file or directory (a directory's fsync makes its entries, e.g. a rename, durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.encode(obj))


def commit(run_dir: Path, version: int, state: RunState, keep: int) -> Path:
    """Finish the checkpoint of ``version`` (its ``.partial`` directory holds everything but the
    state): write the state, flush, rename into place, prune to the newest ``keep``."""
    seal(run_dir, version, state)
    return commit_sealed(run_dir, version, keep)


def seal(run_dir: Path, version: int, state: RunState) -> None:
    """The first half of :func:`commit`: the state written and everything flushed to disk, still
    under the ``.partial`` name (the trainer then waits for the launcher to record the step)."""
    partial = partial_dir(run_dir, version)
    write_json(partial / STATE_FILE, state)
    fsync_tree(partial)


def commit_sealed(run_dir: Path, version: int, keep: int) -> Path:
    """The second half of :func:`commit`: rename the sealed ``.partial`` directory into place, prune."""
    partial = partial_dir(run_dir, version)
    _pause_for_fault_test(version)
    final = checkpoints_dir(run_dir) / checkpoint_name(version)
    if final.exists():  # a resumed run saving the step it resumed from again: replace it
        shutil.rmtree(final)
    partial.rename(final)
    _fsync(final.parent)
    prune(run_dir, keep)
    return final


def _pause_for_fault_test(version: int) -> None:
    """Fault-injection tests only: ``STREAMRL_TEST_PAUSE_BEFORE_COMMIT=VERSION:SECONDS`` holds the
    save of that version just before its rename, so a test can kill the run mid-save."""
    spec = os.environ.get("STREAMRL_TEST_PAUSE_BEFORE_COMMIT", "")
    if spec:
        at, _, seconds = spec.partition(":")
        if int(at) == version:
            time.sleep(float(seconds))


def prune(run_dir: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints, and leftovers of interrupted saves."""
    done = complete_checkpoints(run_dir)
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    root = checkpoints_dir(run_dir)
    newest = int(_NAME.match(done[-1].name).group(1)) if done else -1  # type: ignore[union-attr]
    for p in root.iterdir() if root.is_dir() else []:
        m = _PARTIAL.match(p.name)
        if m and int(m.group(1)) <= newest:
            shutil.rmtree(p, ignore_errors=True)


def start_partial(run_dir: Path, version: int) -> Path:
    """An empty ``.partial`` directory for ``version`` (a leftover of a crashed save is removed)."""
    partial = partial_dir(run_dir, version)
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    return partial


def rng_state() -> dict[str, Any]:
    """This process's RNG states as JSON-able values: torch (CPU and, when present, CUDA), Python."""
    state: dict[str, Any] = {"torch_cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    version, internal, gauss = random.getstate()
    state["python"] = [version, list(internal), gauss]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    def tensor(b64: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(b64)), dtype=torch.uint8)

    torch.set_rng_state(tensor(state["torch_cpu"]))
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensor(s) for s in state["torch_cuda"]])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
