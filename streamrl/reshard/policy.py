"""The awaitable face of the reshard: policy versions moving between training and generation.

Colocated (the same ranks alternate training and generation)::

    policy = ColocatedPolicy(engine, resharder)
    # train stage, after its optimizer step:
    await policy.to_inference(version)      # reshard into inference weights, swap train state out
    # generate stage:
    async with policy.weights.use(min_version) as weights: ...   # forward passes on `weights`
    # train stage, before its next step:
    await policy.to_training()              # waits for the forward passes, swaps train state back

Disaggregated (separate generation workers)::

    sender = WeightSender(engine, resharder)      # on every train rank
    await sender.send(version)                    # after each optimizer step
    await sender.close()                          # at shutdown: releases the receivers
    receiver = WeightReceiver(resharder)          # on every generation worker
    await receiver.run()                          # or: await receiver.receive() per version
    async with receiver.weights.use(min_version) as weights: ...

Collectives and copies block, so they run in a worker thread: ``await`` never blocks the event
loop, and the only thing that waits for a version is whoever awaits it.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Literal, Protocol

import anyio
import anyio.to_thread
import torch

from streamrl.metrics.trace import tracer
from streamrl.reshard.accounting import ReshardReport, SwapReport
from streamrl.reshard.daemon import DaemonCall
from streamrl.reshard.layout import LayoutError
from streamrl.reshard.resharder import HEADER_CLOSE, HEADER_WEIGHTS, Resharder
from streamrl.reshard.weights import InferenceWeights

Phase = Literal["training", "inference"]


class ShardedTrainer(Protocol):
    """What the reshard needs from a train engine (``streamrl.engines.fsdp.FSDPTrainEngine`` is one):
    this rank's shards under the model's parameter names, and the swap of its training state."""

    device: torch.device

    def local_shards(self) -> dict[str, torch.Tensor]: ...

    def offload_state(self) -> SwapReport: ...

    def reload_state(self) -> SwapReport: ...
Announce = Callable[[int, int], Awaitable[None]]  # (header kind, version): see WeightReceiver.receive


class PhaseError(RuntimeError):
    """A colocated transition asked for from the wrong phase."""


class WeightChannelClosedError(RuntimeError):
    """The weight channel was closed and can carry no more versions."""


def _weights_for(resharder: Resharder, device: object) -> InferenceWeights:
    groups = resharder.groups
    return InferenceWeights(
        resharder.inference_shapes(),
        dtype=resharder.inference_dtype,
        device=resharder.device if device is None else device,  # type: ignore[arg-type]
        inference_rank=groups.inference_rank or 0,
        tensor_parallel=resharder.topology.inference.tensor_parallel,
    )


class ColocatedPolicy:
    """One colocated rank's policy: its training shards and its inference weights, one at a time.

    swap_training_state: move parameters, gradients and AdamW moments to host memory for the
        inference phase (the device then holds only the inference weights).
    release_weights_in_training: free the inference weights for the training phase; generation
        waiting in ``weights.use(v)`` resumes at the next ``to_inference``.
    stream_to_engine: the inference weights live in a rollout engine of this process that keeps its
        own copy (vLLM; T = 1), attached with :meth:`attach_engine`: each version's buckets stream
        into its ``load_weights`` as their all-gathers complete (:meth:`Resharder.reshard_local_stream`),
        and ``weights`` holds no tensors (it numbers the versions and keeps installs and generation
        apart). The engine sleeps (``sleep()``) for the training phase and wakes before an install.
    """

    def __init__(
        self,
        engine: ShardedTrainer,
        resharder: Resharder,
        *,
        swap_training_state: bool = True,
        release_weights_in_training: bool = True,
        stream_to_engine: bool = False,
    ) -> None:
        if resharder.topology.placement != "colocated":
            raise LayoutError("ColocatedPolicy needs a colocated topology; use WeightSender/WeightReceiver")
        if stream_to_engine and resharder.topology.inference.tensor_parallel != 1:
            raise LayoutError("stream_to_engine installs whole Hugging Face parameters: it needs inference T = 1")
        self.engine, self.resharder = engine, resharder
        self.swap_training_state = swap_training_state
        self.release_weights_in_training = release_weights_in_training
        self.stream_to_engine = stream_to_engine
        self.rollout_engine: SleepingWeightLoader | None = None
        self.engine_detached = False
        if stream_to_engine:  # no shapes: update() allocates nothing, the engine holds the weights
            self.weights = InferenceWeights({}, dtype=resharder.inference_dtype, device=engine.device)
        else:
            self.weights = _weights_for(resharder, engine.device)
        self.phase: Phase = "training"
        self.last_reshard: ReshardReport | None = None
        self.last_swap: SwapReport | None = None
        self._transition = anyio.Lock()

    def attach_engine(self, engine: SleepingWeightLoader) -> None:
        """The rollout engine the versions stream into (``stream_to_engine``); before the first
        ``to_inference``."""
        if not self.stream_to_engine:
            raise LayoutError("attach_engine is for a ColocatedPolicy made with stream_to_engine=True")
        self.rollout_engine = engine

    async def detach_engine(self) -> None:
        """The engine is about to close (its stage is stopping): wait for an install in flight, then
        stop installing into it. Later versions still run their all-gathers (collective: the other
        ranks' engines may still take them) and drop the result."""
        async with self.weights.update():
            self.rollout_engine = None
            self.engine_detached = True

    def _reshard(self, version: int, tensors: dict[str, torch.Tensor]) -> ReshardReport:
        shards = self.engine.local_shards()
        if not self.stream_to_engine:
            return self.resharder.reshard_local(shards, tensors, version=version)
        engine = self.rollout_engine
        if engine is None and not self.engine_detached:
            raise PhaseError("stream_to_engine: no rollout engine attached; attach_engine() comes first")
        report = ReshardReport(version, "colocated", self.resharder.config.bucket_bytes)
        stream = self.resharder.reshard_local_stream(shards, report)
        if engine is not None:
            engine.wake_up()
        install_stream(engine, stream)  # detached: the gathers still run (collective), the result is dropped
        return report

    async def to_inference(self, version: int) -> ReshardReport:
        """Reshard the current training weights as ``version``, swap the training state out, publish.

        Collective over the train group: every colocated rank calls it with the same version.
        """
        async with self._transition:
            if self.phase != "training":
                raise PhaseError(
                    f"already in the inference phase (version {self.weights.version}); await to_training() first"
                )
            async with self.weights.update() as tensors:

                def work() -> ReshardReport:
                    report = self._reshard(version, tensors)
                    if self.swap_training_state:
                        self.last_swap = self.engine.offload_state()
                    return report

                report = await anyio.to_thread.run_sync(work)
                self.weights.publish(version)
            self.phase = "inference"
            self.last_reshard = report
            return report

    async def to_training(self) -> SwapReport | None:
        """Wait for the forward passes in flight, release the inference weights, swap training state in."""
        async with self._transition:
            if self.phase != "inference":
                raise PhaseError("already in the training phase; to_inference(version) comes first")
            async with self.weights.update():
                if self.release_weights_in_training:
                    self.weights.release()
                if self.rollout_engine is not None:
                    await anyio.to_thread.run_sync(self.rollout_engine.sleep)
                report = None
                if self.swap_training_state:
                    report = await anyio.to_thread.run_sync(self.engine.reload_state)
                    self.last_swap = report
            self.phase = "training"
            return report


class WeightSender:
    """Disaggregated train rank: streams each version's slices to its generation workers."""

    def __init__(self, engine: ShardedTrainer, resharder: Resharder) -> None:
        groups = resharder.groups
        if resharder.topology.placement != "disaggregated" or groups.train is None:
            raise LayoutError("WeightSender runs on the train ranks of a disaggregated topology")
        self.engine, self.resharder = engine, resharder
        self.closed = False
        self.last_version: int | None = None
        self._lock = anyio.Lock()

    async def send(self, version: int) -> ReshardReport:
        """Collective over the train group; returns when this rank's slices are delivered."""
        async with self._lock:
            if self.closed:
                raise WeightChannelClosedError("this WeightSender is closed")
            if self.last_version is not None and version <= self.last_version:
                raise ValueError(
                    f"policy version {version} does not follow the last sent {self.last_version}"
                )
            shards = self.engine.local_shards()
            report = await anyio.to_thread.run_sync(lambda: self.resharder.send(shards, version=version))
            self.last_version = version
            return report

    async def close(self) -> None:
        """Tell this rank's generation workers that no more versions come (their run() returns).

        The send runs in a daemon thread, so a caller's timeout can give up on a worker that no
        longer listens (the header send then stays pending until the process exits).
        """
        async with self._lock:
            if not self.closed:
                self.closed = True
                await DaemonCall(lambda: self.resharder.send_header(HEADER_CLOSE, -1), "streamrl-weight-close").wait()


class WeightLoader(Protocol):
    """An engine that keeps its own copy of the weights (a rollout engine such as vLLM)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...


def install_stream(engine: WeightLoader | None, stream: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Feed a version's stream to ``engine.load_weights``, then run the stream to its end: its
    transfers are collective (all-gathers, or receives matching a sender's sends), so an engine
    that stopped reading early, or none at all, must not leave them half done."""
    if engine is not None:
        engine.load_weights(stream)
    for _ in stream:
        pass


class SleepingWeightLoader(WeightLoader, Protocol):
    """A rollout engine colocated with a train rank: it gives its device memory back for the
    training phase (``sleep``) and takes it again before the next install (``wake_up``); both are
    no-ops where the platform cannot (vLLM on CPU)."""

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...


class WeightReceiver:
    """Disaggregated generation worker: receives versions into its :class:`InferenceWeights`.

    With ``engine`` (T = 1): each version's buckets stream straight into ``engine.load_weights``
    as they arrive (:meth:`Resharder.receive_stream`), and ``weights`` holds no tensors: it only
    numbers the versions and keeps installs and generation apart (readers ``use`` it around a
    generate call; an install takes its exclusive side).
    """

    def __init__(self, resharder: Resharder, engine: WeightLoader | None = None) -> None:
        groups = resharder.groups
        if resharder.topology.placement != "disaggregated" or groups.weight_source is None:
            raise LayoutError("WeightReceiver runs on the generation workers of a disaggregated topology")
        self.resharder = resharder
        self.engine = engine
        if engine is None:
            self.weights = _weights_for(resharder, None)
        else:  # no shapes: update() allocates nothing, the engine holds the weights
            self.weights = InferenceWeights({}, dtype=resharder.inference_dtype, device=resharder.device)
        self.closed = False
        self.installed = 0  # versions received and published so far
        self.last_report: ReshardReport | None = None
        self._header: DaemonCall | None = None  # the header wait in flight, kept across cancellations

    async def receive(self, announce: Announce | None = None) -> ReshardReport | None:
        """Wait for the next version and install it; None once the sender has closed.

        ``announce(kind, version)`` runs once the header is in (``HEADER_WEIGHTS`` inside the
        exclusive side of the weights, so under no forward pass; ``HEADER_CLOSE`` with version -1):
        a tensor-parallel rank 0 uses it to have its group's other ranks receive theirs at the same
        point of its command stream.

        Cancelling it while it waits for the header loses nothing (the next call resumes the same
        wait). Once the header is in, the rest is shielded: the version is installed, then the
        cancellation takes effect.
        """
        if self.closed:
            return None
        if self._header is None:
            self._header = DaemonCall(self.resharder.receive_header, "streamrl-weight-header")
        header = await self._header.wait()
        self._header = None
        kind, version = header
        # Shielded from here: the header is consumed and the sender streams this version's buckets
        # next. Given up half-way (e.g. cancelled while waiting for a forward pass's lease), the
        # channel would read bucket data as the next header. Every wait below ends on its own: the
        # leases when their forward passes do, the transfer when the sender's sends do.
        with anyio.CancelScope(shield=True):
            if kind == HEADER_CLOSE:
                self.closed = True
                if announce is not None:
                    await announce(HEADER_CLOSE, -1)
                return None
            assert kind == HEADER_WEIGHTS
            started = time.perf_counter()
            async with self.weights.update() as tensors:
                if announce is not None:
                    await announce(HEADER_WEIGHTS, version)
                report = await anyio.to_thread.run_sync(lambda: self._install(tensors, version))
                self.weights.publish(version)
            trace = tracer()
            trace.complete("receive weights", "policy", started, time.perf_counter(), "policy", version=version)
            trace.counter("policy version", version)
        self.installed += 1
        self.last_report = report
        return report

    def _install(self, tensors: dict[str, torch.Tensor], version: int) -> ReshardReport:
        if self.engine is None:
            return self.resharder.receive(tensors, version=version)
        report = ReshardReport(version, "receiver", self.resharder.config.bucket_bytes)
        install_stream(self.engine, self.resharder.receive_stream(report))
        return report

    async def wait_closed(self, timeout_s: float, announce: Announce | None = None) -> bool:
        """Install versions until the sender closes the channel, for at most ``timeout_s``.

        True once closed: no receive is pending, so the process group can be destroyed safely.
        """
        with anyio.move_on_after(timeout_s):
            while await self.receive(announce) is not None:
                pass
        return self.closed

    async def run(self, announce: Announce | None = None) -> int:
        """Receive versions until the sender closes; returns how many were installed in all."""
        while await self.receive(announce) is not None:
            pass
        return self.installed
