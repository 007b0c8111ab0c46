"""What an agent endpoint generates with: the live policy behind a rollout engine, many sessions'
requests batched together.

:class:`BatchingBackend` wraps any :class:`~streamrl.engines.rollout_engine.RolloutEngine` (the
built-in torch engine, vLLM). The requests that share their sampling settings (temperature, top_p,
top_k) run as one ``generate`` call, each cut to its own ``max_tokens`` afterwards (the first k
tokens of a longer draw are a draw of k); one call runs at a time.

``chunk_tokens`` (continuous batching): each call generates at most that many more tokens for every
request still running, and a request that is neither finished (end-of-sequence, or its
``max_tokens``) nor cancelled goes on in the next call, its prompt then its tokens so far as the
prompt. Requests that arrive meanwhile join at the next call instead of waiting for the longest
generation to end, and finished ones leave; an engine without a cache across calls pays one
prefill of the request's tokens per chunk for that. Without it, a request's whole completion is
one call, and a request that arrives while one runs waits for it.

Each request samples from a random stream of its own (``stream``: a seed; the k-th token of its
completion is the stream's k-th draw, :func:`~streamrl.engines.rollout.stream_uniforms` on the
built-in engine), so its tokens do not depend on which requests it was batched with or when it
arrived: with the same policy and prompt, the same stream gives the same completion. A request
without one gets a stream drawn from the backend's ``seed`` in arrival order.

Each call holds the source for its length (``hold``), so a new policy version goes in between two
calls. With ``chunk_tokens`` that can be in the middle of a completion: each token carries the
version that sampled it (``Completion.versions``). :meth:`BatchingBackend.pinned` holds one version
for a whole block instead (no version changes inside it). When idle, the first request waits
``window_s`` for others to join it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch
from torch import Tensor

from streamrl.engines.rollout_engine import EngineRollout, RolloutEngine
from streamrl.loop_affinity import released


@dataclass(frozen=True)
class SamplingKey:
    temperature: float
    top_p: float
    top_k: int


@dataclass
class Completion:
    ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop": the engine sampled end-of-sequence (ids[-1]); "length": max_tokens reached
    versions: list[int]  # the policy version that sampled each token

    @property
    def version(self) -> int:
        """The oldest version among its tokens (what its staleness is measured on)."""
        return min(self.versions, default=-1)


@dataclass
class _Request:
    prompt: list[int]
    max_tokens: int
    key: SamplingKey
    stream: int  # the seed of the request's random stream (its k-th token: the stream's k-th draw)
    done: anyio.Event = field(default_factory=anyio.Event)
    ids: list[int] = field(default_factory=list)  # sampled so far
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    result: Completion | None = None
    error: BaseException | None = None


@dataclass
class BackendStatistics:
    requests: int = 0
    engine_calls: int = 0
    tokens: int = 0  # completion tokens generated
    busy_s: float = 0.0  # seconds inside the engine
    largest_batch: int = 0


class OwnWeights:
    """A rollout engine that holds its own weights, as a weight source: :meth:`install` puts a new
    version in between two ``hold`` blocks (tests and benchmarks; a run's stage uses its placement's
    :class:`~streamrl.stages.weight_source.WeightSource`)."""

    def __init__(self, engine: RolloutEngine, version: int = 0) -> None:
        self.engine, self.version = engine, version
        self.generator_device = engine.generator_device
        self._changed = anyio.Condition()  # its lock: one generate or install at a time
        self.installs_waiting = 0  # installs queued behind a hold

    @asynccontextmanager
    async def hold(self, need: int) -> AsyncIterator[EngineRollout]:
        async with self._changed:
            while self.version < need:
                await self._changed.wait()
            yield EngineRollout(self.engine, self.version)

    async def install(self, weights: Iterable[tuple[str, Tensor]], version: int) -> None:
        """A new policy version, between two holds (tokens sampled after it carry ``version``)."""
        self.installs_waiting += 1
        async with self._changed:
            self.installs_waiting -= 1
            await anyio.to_thread.run_sync(released, self.engine.load_weights, weights)
            self.version = version
            self._changed.notify_all()

    async def close(self) -> None:
        await anyio.to_thread.run_sync(self.engine.close)


class BatchingBackend:
    """Batches concurrent completion requests into ``generate`` calls on ``weights`` (see the module doc).

    ``eos_token_id``: the token that ends a completion ("stop"). ``window_s``: how long the first
    request waits for others when the backend is idle. ``max_batch``: requests per engine call at
    most. ``chunk_tokens``: tokens per request per call (None: whole completions).
    """

    def __init__(self, weights: Any, eos_token_id: int, *, window_s: float = 0.005,
                 max_batch: int = 256, seed: int = 0, chunk_tokens: int | None = None) -> None:
        if window_s < 0 or max_batch < 1 or (chunk_tokens is not None and chunk_tokens < 1):
            raise ValueError(f"window_s must be >= 0, max_batch >= 1 and chunk_tokens >= 1 or None, got {window_s}, "
                             f"{max_batch}, {chunk_tokens}")
        self.weights = weights
        self.eos_token_id = eos_token_id
        self.window_s = window_s
        self.max_batch = max_batch
        self.chunk_tokens = chunk_tokens
        self.seed = seed  # what the streams of a caller's requests are named under (AgentEndpoint's sessions)
        self.generator = torch.Generator(device=weights.generator_device).manual_seed(seed)
        self._queue: list[_Request] = []  # arrived, not yet in a call
        self._running: list[_Request] = []  # chunked: in a call before, not finished
        self._wake = anyio.Event()
        self._pinned: Any = None  # the rollout every call uses inside a ``pinned`` block
        self._closed = False
        self.stats = BackendStatistics()

    async def complete(self, prompt: list[int], *, max_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                       top_k: int = 0, stream: int | None = None) -> Completion:
        """One completion of ``prompt`` (token ids), batched with whatever else is asked meanwhile.
        ``stream``: the seed of its random stream (an int64; None: one drawn from the backend's)."""
        if self._closed:
            raise RuntimeError("the backend is closed")
        if stream is None:
            stream = int(torch.randint(0, 2**62, (1,), generator=self.generator, device=self.generator.device))
        req = _Request(list(prompt), max_tokens, SamplingKey(temperature, top_p, top_k), stream)
        self._queue.append(req)
        self._wake.set()
        self.stats.requests += 1
        await req.done.wait()
        if req.error is not None:
            raise req.error
        assert req.result is not None
        return req.result

    async def run(self) -> None:
        """Serve the queue until :meth:`close` (run it in a task group)."""
        while not self._closed:
            if not self._queue and not self._running:
                await self._wake.wait()
                await anyio.sleep(self.window_s)  # let the requests of other sessions join
            self._wake = anyio.Event()
            waiting = [*self._running, *self._queue]  # the running first: they are the oldest
            if not waiting or self._closed:
                continue
            key = waiting[0].key
            batch = [r for r in waiting if r.key == key][: self.max_batch]
            taken = {id(r) for r in batch}
            self._queue = [r for r in self._queue if id(r) not in taken]
            others = [r for r in self._running if id(r) not in taken]
            await self._generate(key, batch)
            # the unfinished go after the other keys' requests: no sampling setting waits for another's
            self._running = [*others, *(r for r in batch if not r.done.is_set())]

    @asynccontextmanager
    async def pinned(self, need: int) -> AsyncIterator[int]:
        """Every call inside the block samples with one version ``>= need`` (yielded): no version
        changes under it. The block must not overlap another ``pinned``."""
        async with self.weights.hold(need) as rollout:
            self._pinned = rollout
            try:
                yield rollout.version
            finally:
                self._pinned = None

    async def _generate(self, key: SamplingKey, batch: list[_Request]) -> None:
        if self._pinned is not None:
            await self._generate_on(self._pinned, key, batch)
            return
        try:
            async with self.weights.hold(0) as rollout:  # the newest version there is, for this call
                await self._generate_on(rollout, key, batch)
        except Exception as exc:  # the source failed: each request of the batch fails with it
            for r in batch:
                if not r.done.is_set():
                    r.error = exc
                    r.done.set()

    async def _generate_on(self, rollout: Any, key: SamplingKey, batch: list[_Request]) -> None:
        started = time.perf_counter()
        try:
            gens = await anyio.to_thread.run_sync(released, self._call, rollout, key, batch)
        except Exception as exc:  # each request of the batch fails with it; the backend goes on
            for r in batch:
                r.error = exc
                r.done.set()
            return
        self.stats.busy_s += time.perf_counter() - started
        self.stats.engine_calls += 1
        self.stats.largest_batch = max(self.stats.largest_batch, len(batch))
        for r, g in zip(batch, gens, strict=True):
            ids = g.response_ids.tolist()[: r.max_tokens - len(r.ids)]
            r.ids += ids
            r.logprobs += g.logprobs.tolist()[: len(ids)]
            r.versions += [rollout.version] * len(ids)
            self.stats.tokens += len(ids)
            stopped = bool(ids) and ids[-1] == self.eos_token_id
            if stopped or len(r.ids) >= r.max_tokens or not ids:  # (no token: the engine ended it)
                r.result = Completion(r.ids, r.logprobs, "stop" if stopped else "length", r.versions)
                r.done.set()

    def _call(self, rollout: Any, key: SamplingKey, batch: list[_Request]) -> list[Any]:
        prompts: list[Tensor] = [torch.tensor(r.prompt + r.ids, dtype=torch.int64) for r in batch]
        left = max(r.max_tokens - len(r.ids) for r in batch)
        # each request's stream goes on where its previous chunk stopped
        return rollout.generate(prompts, max_new_tokens=min(left, self.chunk_tokens or left),
                                temperature=key.temperature, top_p=key.top_p, top_k=key.top_k,
                                generator=self.generator, streams=[(r.stream, len(r.ids)) for r in batch])

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        for r in [*self._queue, *self._running]:
            r.error = RuntimeError("the backend closed before this request finished")
            r.done.set()
        self._queue.clear()
        self._running.clear()
