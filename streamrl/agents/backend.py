"""What an agent endpoint generates with: the live policy behind a rollout engine, many sessions'
requests batched together.

:class:`BatchingBackend` wraps any :class:`~streamrl.engines.rollout_engine.RolloutEngine` (the
built-in torch engine, vLLM). Requests wait at most ``window_s`` for others to join them; the
requests that share their sampling settings (temperature, top_p, top_k) then run as one
``generate`` call, to the longest ``max_tokens`` among them, each cut to its own afterwards (the
first k tokens of a longer draw are a draw of k). One call runs at a time: a request that arrives
while one runs joins the next. A new policy version (:meth:`install`) goes in between two calls,
so every token of a completion comes from one version, which the completion carries.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch
from torch import Tensor

from streamrl.engines.rollout_engine import RolloutEngine


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
    version: int  # the policy version every token was sampled with


@dataclass
class _Request:
    prompt: list[int]
    max_tokens: int
    key: SamplingKey
    done: anyio.Event = field(default_factory=anyio.Event)
    result: Completion | None = None
    error: BaseException | None = None


@dataclass
class BackendStatistics:
    requests: int = 0
    engine_calls: int = 0
    tokens: int = 0  # completion tokens generated
    busy_s: float = 0.0  # seconds inside the engine
    largest_batch: int = 0


class BatchingBackend:
    """Batches concurrent completion requests into ``engine.generate`` calls.

    ``eos_token_id``: the token that ends a completion ("stop"). ``window_s``: how long the first
    request of a batch waits for others. ``max_batch``: requests per engine call at most.
    """

    def __init__(self, engine: RolloutEngine, eos_token_id: int, *, window_s: float = 0.005,
                 max_batch: int = 256, seed: int = 0) -> None:
        if window_s < 0 or max_batch < 1:
            raise ValueError(f"window_s must be >= 0 and max_batch >= 1, got {window_s}, {max_batch}")
        self.engine = engine
        self.eos_token_id = eos_token_id
        self.window_s = window_s
        self.max_batch = max_batch
        self.version = 0
        self.generator = torch.Generator(device=engine.generator_device).manual_seed(seed)
        self._queue: list[_Request] = []
        self._wake = anyio.Event()
        self._lock = anyio.Lock()  # the engine: one generate or install at a time
        self._closed = False
        self.stats = BackendStatistics()

    async def complete(self, prompt: list[int], *, max_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                       top_k: int = 0) -> Completion:
        """One completion of ``prompt`` (token ids), batched with whatever else is asked meanwhile."""
        if self._closed:
            raise RuntimeError("the backend is closed")
        req = _Request(list(prompt), max_tokens, SamplingKey(temperature, top_p, top_k))
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
            await self._wake.wait()
            self._wake = anyio.Event()
            await anyio.sleep(self.window_s)  # let the requests of other sessions join
            while self._queue and not self._closed:
                key = self._queue[0].key
                batch = [r for r in self._queue if r.key == key][: self.max_batch]
                taken = {id(r) for r in batch}
                self._queue = [r for r in self._queue if id(r) not in taken]
                await self._generate(key, batch)

    async def _generate(self, key: SamplingKey, batch: list[_Request]) -> None:
        async with self._lock:
            started = time.perf_counter()
            try:
                gens = await anyio.to_thread.run_sync(self._call, key, batch)
            except Exception as exc:  # each request of the batch fails with it; the backend goes on
                for r in batch:
                    r.error = exc
                    r.done.set()
                return
            self.stats.busy_s += time.perf_counter() - started
            self.stats.engine_calls += 1
            self.stats.largest_batch = max(self.stats.largest_batch, len(batch))
            for r, g in zip(batch, gens, strict=True):
                ids = g.response_ids.tolist()[: r.max_tokens]
                logprobs = g.logprobs.tolist()[: r.max_tokens]
                stopped = bool(ids) and ids[-1] == self.eos_token_id
                r.result = Completion(ids, logprobs, "stop" if stopped else "length", self.version)
                self.stats.tokens += len(ids)
                r.done.set()

    def _call(self, key: SamplingKey, batch: list[_Request]) -> list[Any]:
        prompts: list[Tensor] = [torch.tensor(r.prompt, dtype=torch.int64) for r in batch]
        return self.engine.generate(prompts, max_new_tokens=max(r.max_tokens for r in batch),
                                    temperature=key.temperature, top_p=key.top_p, top_k=key.top_k,
                                    generator=self.generator)

    async def install(self, weights: Iterable[tuple[str, Tensor]], version: int) -> None:
        """A new policy version, between two engine calls (completions after it carry ``version``)."""
        async with self._lock:
            await anyio.to_thread.run_sync(self.engine.load_weights, weights)
            self.version = version

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        for r in self._queue:
            r.error = RuntimeError("the backend closed before this request ran")
            r.done.set()
        self._queue.clear()
