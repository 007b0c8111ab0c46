"""A host's CPU cores shared among the compute calls of a run's stages (``resources.core_share``).

On a CPU host every computing stage (generate, train, reference, ...) is its own process with
its own pool of torch (OpenMP) threads. A fixed pool per stage fits only one moment: when two
stages compute at once, pools that add up to more than the cores slow both (threads preempt
each other inside every parallel region); when one computes alone, a pool sized for sharing
leaves cores idle. In a streamed RL step both happen within a second: generation alone, then
generation beside training, then training alone.

So each compute call marks its thread busy in a directory that the run's workers on this host
share (:meth:`CoreShare.computing`: one empty file per computing thread, named by process and
thread, in the run's shared-memory scratch directory), and the engines call :func:`rebalance`
at each decoder layer (forward and backward) and each decode step. ``rebalance`` gives the
calling thread ``min(threads, cores // busy)`` torch threads: the stage's whole ``threads``
while it computes alone, an equal share of the cores while others compute too. Threads change
between layers, never inside an operator.

A small layer gets fewer: the engines pass each layer's or decode step's ``work`` (its rows
times its width squared, in proportion to its matmul FLOPs), and a call gets one thread per
:data:`LAYER_GRAIN` of it (:data:`DECODE_GRAIN` in a decode step). On less work a second
thread gives little, while its team's waits burn a core that the run's other processes
(rewards, the dock, the controller) need.

Why the OpenMP waits matter: a parallel region's threads wait for the next region by spinning,
then sleep. Passive waits (no spin) make each of the thousands of small regions of a step pay a
wake-up, which cost more than a second thread gives; long spins (OpenMP's default, about a
millisecond or more) burn cores another stage needs. The share keeps at most one thread per core
busy, so the workers spin a short while (``GOMP_SPINCOUNT``, set by
:mod:`streamrl.runtime.forkserver`) and then sleep.

A call outside :meth:`CoreShare.computing` (an engine used directly, a test) is not affected:
:func:`rebalance` does nothing there.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from streamrl.runtime.orphans import process_alive

# Work (rows x width^2) per torch thread of a decoder layer's forward or backward (training,
# reference logprobs, the prefill): a team of n threads forms from n x 4M. A second thread sped a
# Qwen2 decoder layer up 0.7-1.2x under 2M, about 1.2x at 4M, 1.3-1.5x at 8M and 1.5-1.9x from
# 16M (`python ops/bench/core_share.py --grain`, docs/benchmarks.md section 19), while a team's
# spinning waits take a core from the run's other processes.
LAYER_GRAIN = 4 * 2**20
# Work per torch thread of a decode step: a team from 2M. A decode step gains from a second
# thread at less matmul work than a layer alone, because its attention over each row's cache
# and its sampling split across the rows too: at 4M W2's generation was 20-30 % slower.
DECODE_GRAIN = 2**20

# Parameters per torch thread of the train engine's optimizer step: a team of 2 from 16 Mi. The
# step is bound by memory bandwidth, and once its fused operator runs the share cannot take a thread
# back when another stage starts computing beside it. On a quiet host its second thread sped the
# step up 1.0-1.25x at 0.3-2.6M parameters and 1.4x at 21M; beside a busy core it slowed it 4-8x
# (0.3-2.6M) and 2.5x (21M) (`python ops/bench/core_share.py --optimizer`, docs/benchmarks.md §19).
ELEMENTWISE_GRAIN = 8 * 2**20

_local = threading.local()  # .share: the CoreShare this thread computes under; .threads: its torch threads


class CoreShareError(ValueError):
    """A core share was asked for with an impossible setting; the message names it."""


@dataclass(frozen=True, slots=True)
class CoreShareStatistics:
    """What one process's share did: compute ``calls`` marked busy, ``rebalances`` (looks at the
    busy count), ``changes`` of a thread's torch threads, and the ``threads`` the last look gave
    (0 before any)."""

    calls: int
    rebalances: int
    changes: int
    threads: int


class CoreShare:
    """This process's part in the host's share (one per worker process; its stages' compute
    threads use it)."""

    def __init__(self, directory: Path, threads: int, *, cores: int | None = None) -> None:
        """``directory``: shared by every worker of the run on this host (created if missing);
        ``threads``: the most torch threads a compute call of this process uses; ``cores``: the
        cores to share (default: those this process may run on)."""
        if threads < 1:
            raise CoreShareError(f"threads must be >= 1, got {threads}")
        available = cores if cores is not None else len(os.sched_getaffinity(0))
        if available < 1:
            raise CoreShareError(f"cores must be >= 1, got {available}")
        self.directory, self.threads, self.cores = directory, threads, available
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._pid = os.getpid()
        self._calls = self._rebalances = self._changes = self._last = 0

    @contextmanager
    def computing(self) -> Iterator[None]:
        """Mark the calling thread busy for the block, with its share of the cores from the start."""
        if getattr(_local, "share", None) is not None:  # nested: the outer block holds the marker
            yield
            return
        marker = self.directory / f"{self._pid}-{threading.get_native_id()}"
        marker.touch()
        _local.share = self
        self._calls += 1
        try:
            self.rebalance()
            yield
        finally:
            _local.share = None
            marker.unlink(missing_ok=True)

    def busy(self) -> int:
        """Threads computing on this host now (this one included when it computes)."""
        count = 0
        for name in os.listdir(self.directory):
            pid = name.split("-", 1)[0]
            # a killed worker's marker counts no more
            if pid.isdigit() and (int(pid) == self._pid or process_alive(int(pid))):
                count += 1
        return count

    def rebalance(self, work: int | None = None, grain: int | None = None) -> int:
        """Set the calling thread's torch threads to its share now, and to one per ``grain``
        (default :data:`LAYER_GRAIN`) of ``work`` (what follows: rows x width^2; None: no cap);
        returns it."""
        share = self.threads if work is None else min(self.threads, work // (grain or LAYER_GRAIN))
        if share > 1:  # one thread needs no look at the others (a small layer's hot path)
            share = min(share, self.cores // max(self.busy(), 1))
        share = max(1, share)
        self._rebalances += 1
        self._last = share
        if getattr(_local, "threads", None) != share:
            torch.set_num_threads(share)  # this thread's OpenMP pool (and MKL's)
            _local.threads = share
            self._changes += 1
        return share

    def statistics(self) -> CoreShareStatistics:
        return CoreShareStatistics(self._calls, self._rebalances, self._changes, self._last)


def rebalance(work: int | None = None, grain: int | None = None) -> None:
    """The engines' hook: the calling thread's share of the cores for the next ``work`` (rows x
    width^2; None: no cap) at one thread per ``grain`` (default :data:`LAYER_GRAIN`), where it computes under a
    :class:`CoreShare`; nothing elsewhere."""
    share: CoreShare | None = getattr(_local, "share", None)
    if share is not None:
        share.rebalance(work, grain)


def rebalance_for_elementwise(elements: int) -> None:
    """The engines' hook before a pass of elementwise work over ``elements`` values per tensor (the
    optimizer step over a rank's parameters: gradient scaling and norm, AdamW): one torch thread
    per :data:`ELEMENTWISE_GRAIN`, where it computes under a :class:`CoreShare`."""
    rebalance(elements, ELEMENTWISE_GRAIN)


def work(rows: int, width: int) -> int:
    """The unit the grains count: a forward over ``rows`` of a ``width``-wide model, rows x width^2
    (in proportion to its matmul FLOPs)."""
    return rows * width * width


def layer_work(hidden: object) -> int | None:
    """The work of a layer over ``hidden`` ([..., width] activations)."""
    if not isinstance(hidden, Tensor) or hidden.dim() == 0:
        return None
    return work(hidden.numel() // hidden.shape[-1], hidden.shape[-1]) if hidden.shape[-1] else 0


def rebalance_at_layers(layers: Iterable[nn.Module]) -> None:
    """Call :func:`rebalance` before each of ``layers``' forward and before its backward, with
    the work of the layer's input (forward) or of its output's gradient (backward)."""
    for layer in layers:
        layer.register_forward_pre_hook(_before_forward, with_kwargs=True)
        layer.register_forward_hook(_before_backward)


def _before_forward(module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
    rebalance(layer_work(args[0] if args else kwargs.get("hidden_states")))


def _before_backward(module: nn.Module, args: object, output: object) -> None:
    # A hook on the layer's output gradient runs when the backward reaches the layer: lighter
    # than a module backward hook, which wraps every input and output in an autograd node.
    if getattr(_local, "share", None) is None or not torch.is_grad_enabled():
        return
    out = output[0] if isinstance(output, tuple) and output else output
    if isinstance(out, Tensor) and out.requires_grad:
        out.register_hook(_on_output_grad)


def _on_output_grad(grad: Tensor) -> None:
    rebalance(layer_work(grad))
