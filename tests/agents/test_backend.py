"""The batching backend's continuous batching (``chunk_tokens``): a request that arrives while a long
completion runs joins at the next engine call and finishes first, every token is what the engine
sampled, and a version installed in the middle of a completion stamps the tokens after it."""

from __future__ import annotations

import threading
from typing import Any

import anyio
import pytest
import torch

from streamrl.agents.backend import BatchingBackend, Completion, OwnWeights
from streamrl.engines.rollout import Generation, TorchRolloutEngine
from streamrl.models.build import build_model
from streamrl.models.spec import TinyModelSpec
from streamrl.models.tokenizer import build_char_tokenizer

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]
NEVER = 10_000  # an end-of-sequence id the model cannot sample: every completion runs to max_tokens


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class CallLog(TorchRolloutEngine):
    """The built-in engine, logging each call's prompts and what it sampled."""

    def __init__(self, model: Any) -> None:
        super().__init__(model, NEVER, 0, "cpu")
        self.calls: list[tuple[list[list[int]], list[Generation]]] = []
        self.first_call = threading.Event()
        self.go = threading.Event()  # the first call returns once it is set (or after 30 s)

    def generate(self, prompts: list[torch.Tensor], **kwargs: Any) -> list[Generation]:
        self.first_call.set()
        self.go.wait(30.0)
        out = super().generate(prompts, **kwargs)
        self.calls.append(([p.tolist() for p in prompts], out))
        return out


def _model(seed: int = 0) -> Any:
    tok = build_char_tokenizer()
    return build_model(TinyModelSpec(arch="qwen2", hidden=32, layers=1, heads=2, intermediate=64, max_positions=256,
                                     seed=seed), tok).eval()


def _replay(engine: CallLog, prompt: list[int]) -> tuple[list[int], list[float]]:
    """A request's tokens and logprobs put together from the calls whose prompt continued it."""
    ids: list[int] = []
    logprobs: list[float] = []
    for prompts, gens in engine.calls:
        for p, g in zip(prompts, gens, strict=True):
            if p == prompt + ids:
                ids += g.response_ids.tolist()
                logprobs += g.logprobs.tolist()
                break
    return ids, logprobs


async def test_a_request_joins_a_running_completion_at_the_next_chunk_and_finishes_first() -> None:
    engine = CallLog(_model())
    engine.go.set()
    backend = BatchingBackend(OwnWeights(engine), NEVER, window_s=0.0, chunk_tokens=4, seed=1)
    long_prompt, short_prompt = [3, 4, 5], [6, 7]
    finished: list[str] = []
    results: dict[str, Completion] = {}

    async def ask(name: str, prompt: list[int], max_tokens: int) -> None:
        results[name] = await backend.complete(prompt, max_tokens=max_tokens)
        finished.append(name)

    async with anyio.create_task_group() as tg:
        tg.start_soon(backend.run)
        tg.start_soon(ask, "long", long_prompt, 40)
        with anyio.fail_after(30):
            while backend.stats.engine_calls < 1:
                await anyio.sleep(0.001)
        tg.start_soon(ask, "short", short_prompt, 6)
        with anyio.fail_after(60):
            while len(finished) < 2:
                await anyio.sleep(0.005)
        backend.close()
        tg.cancel_scope.cancel()
    assert finished == ["short", "long"]  # it did not wait for the 40-token completion
    assert [len(results["long"].ids), len(results["short"].ids)] == [40, 6]
    assert len(engine.calls) == 10  # 40 tokens in chunks of 4, the short one riding along in two of them
    assert max(len(prompts) for prompts, _ in engine.calls) == 2
    for name, prompt in (("long", long_prompt), ("short", short_prompt)):
        ids, logprobs = _replay(engine, prompt)
        cut = len(results[name].ids)
        assert results[name].ids == ids[:cut] and results[name].logprobs == logprobs[:cut]  # bitwise
        assert results[name].finish_reason == "length" and results[name].versions == [0] * cut


async def test_a_version_installed_mid_completion_stamps_the_tokens_after_it() -> None:
    engine = CallLog(_model(seed=0))
    newer = _model(seed=7).state_dict()
    weights = OwnWeights(engine)
    backend = BatchingBackend(weights, NEVER, window_s=0.0, chunk_tokens=4, seed=2)
    prompt = [3, 4, 5, 6]
    out: list[Completion] = []

    async def install_during_the_first_call() -> None:
        await anyio.to_thread.run_sync(engine.first_call.wait, 30.0)
        async with anyio.create_task_group() as tg:
            tg.start_soon(weights.install, newer.items(), 1)  # waits for the running call: in between the chunks
            with anyio.fail_after(30):
                while not weights.installs_waiting:
                    await anyio.sleep(0.001)
            engine.go.set()  # the first call ends only now, with the install queued behind it

    async def ask() -> None:
        out.append(await backend.complete(prompt, max_tokens=12))

    async with anyio.create_task_group() as tg:
        tg.start_soon(backend.run)
        tg.start_soon(install_during_the_first_call)
        tg.start_soon(ask)
        with anyio.fail_after(60):
            while not out:
                await anyio.sleep(0.005)
        backend.close()
        tg.cancel_scope.cancel()
    done = out[0]
    assert done.versions == [0] * 4 + [1] * 8 and done.version == 0
    # the tokens after the install have the newer weights' logprobs (a teacher-forced forward)
    full = torch.tensor([prompt + done.ids])
    for weights, span in ((_model(seed=0), range(0, 4)), (_model(seed=7), range(4, 12))):
        with torch.no_grad():
            lp = torch.log_softmax(weights(full).logits[0].float(), -1)
        expected = [lp[len(prompt) + k - 1, done.ids[k]].item() for k in span]
        assert torch.allclose(torch.tensor([done.logprobs[k] for k in span]), torch.tensor(expected), atol=1e-5)


async def _complete_all(backend: BatchingBackend, asks: list[tuple[list[int], int, int | None]]) -> list[Completion]:
    """Each (prompt, max_tokens, stream) asked at once; their completions in that order."""
    results: list[Completion | None] = [None] * len(asks)

    async def ask(i: int) -> None:
        prompt, max_tokens, stream = asks[i]
        results[i] = await backend.complete(prompt, max_tokens=max_tokens, stream=stream)

    async with anyio.create_task_group() as tg:
        tg.start_soon(backend.run)
        with anyio.fail_after(60):
            async with anyio.create_task_group() as inner:
                for i in range(len(asks)):
                    inner.start_soon(ask, i)
        backend.close()
        tg.cancel_scope.cancel()
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]


@pytest.mark.parametrize("chunk_tokens", [None, 3])
async def test_a_requests_stream_decides_its_tokens_whoever_it_is_batched_with(chunk_tokens: int | None) -> None:
    """The same prompt and stream give the same completion alone, batched with others that arrive
    with it, and split into chunks or not (the built-in engine draws a stream's k-th token at k)."""
    model = _model()
    prompt = [3, 4, 5]

    def backend() -> BatchingBackend:
        engine = TorchRolloutEngine(model, NEVER, 0, "cpu")
        return BatchingBackend(OwnWeights(engine), NEVER, window_s=0.0, chunk_tokens=chunk_tokens, seed=5)

    alone = (await _complete_all(backend(), [(prompt, 10, 42)]))[0]
    crowd = await _complete_all(backend(), [([6, 7], 4, 1), ([8], 12, 2), (prompt, 10, 42), (prompt, 10, 43)])
    assert crowd[2].ids == alone.ids and crowd[2].logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    assert crowd[3].ids != alone.ids  # another stream, another draw
    whole = (await _complete_all(BatchingBackend(OwnWeights(TorchRolloutEngine(model, NEVER, 0, "cpu")), NEVER,
                                                 window_s=0.0, seed=5), [(prompt, 10, 42)]))[0]
    assert whole.ids == alone.ids
