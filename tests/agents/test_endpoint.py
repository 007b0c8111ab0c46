"""The agent endpoint driven by the real ``openai`` SDK: multi-turn sessions with tool calls whose
trajectories hold exactly what the engine sampled, forks where a template rewrites history, and
bad requests answered with a 4xx while the server goes on serving."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import anyio
import pytest
import torch

from streamrl.agents.backend import BatchingBackend, OwnWeights
from streamrl.agents.endpoint import AgentEndpoint, EndpointConfig
from streamrl.engines.rollout import Generation, TorchRolloutEngine
from streamrl.models.build import TinyModelSpec, build_model
from tests.agents.templates import QWEN3, QWEN25, tokenizer

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                           "parameters": {"type": "object", "properties": {
                                               "a": {"type": "number"}, "b": {"type": "number"}}}}}]
MAX_POSITIONS = 2048


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class RecordingEngine(TorchRolloutEngine):
    """The built-in engine, keeping every Generation it returned (what the policy sampled)."""

    def __init__(self, model: Any, tok: Any) -> None:
        super().__init__(model, tok.eos_token_id, tok.pad_token_id, "cpu")
        self.sampled: list[Generation] = []

    def generate(self, prompts: list[torch.Tensor], **kwargs: Any) -> list[Generation]:
        out = super().generate(prompts, **kwargs)
        self.sampled.extend(out)
        return out


class ScriptedEngine(RecordingEngine):
    """The built-in engine's model made to answer a script: the reply's tokens come from
    ``script(prompt_text)``, their logprobs from the model itself (one teacher-forced forward), so
    an agent sees the tool calls it is to exercise and the endpoint real numbers."""

    def __init__(self, model: Any, tok: Any, script: Callable[[str], str]) -> None:
        super().__init__(model, tok)
        self.tok, self.script = tok, script

    def generate(self, prompts: list[torch.Tensor], *, max_new_tokens: int, temperature: float = 1.0,
                 **kwargs: Any) -> list[Generation]:
        out = []
        for p in prompts:
            text = self.script(self.tok.decode(p.tolist(), skip_special_tokens=False))
            ids = [*self.tok.encode(text, add_special_tokens=False)[: max_new_tokens - 1], self.tok.eos_token_id]
            full = torch.cat([p, torch.tensor(ids)])
            with torch.no_grad():
                logits = self.model(full[None].to(self.device)).logits[0, len(p) - 1:-1].float() / temperature
            logprobs = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None])[:, 0]
            out.append(Generation(torch.tensor(ids), logprobs.cpu(), "eos"))
        self.sampled.extend(out)
        return out


def _model(tok: Any) -> Any:
    return build_model(TinyModelSpec(arch="qwen2", hidden=32, layers=1, heads=2, intermediate=64,
                                     max_positions=MAX_POSITIONS, seed=0), tok)


_clients: list[Any] = []  # the SDK clients a test made: closed with its endpoint


@contextlib.asynccontextmanager
async def _endpoint(engine: RecordingEngine, tok: Any, **config: Any) -> AsyncIterator[AgentEndpoint]:
    backend = BatchingBackend(OwnWeights(engine), tok.eos_token_id, window_s=0.01)
    try:
        async with AgentEndpoint(backend, tok, EndpointConfig(max_positions=MAX_POSITIONS, max_tokens=48,
                                                              **config)) as ep:
            yield ep
    finally:
        while _clients:
            await _clients.pop().close()


def _client(ep: AgentEndpoint, session: str | None = None) -> Any:
    key = ep.config.api_key if session is None else f"{ep.config.api_key}:{session}"
    client = openai.AsyncOpenAI(base_url=ep.url, api_key=key, max_retries=0, timeout=60)
    _clients.append(client)
    return client


async def _reward(ep: AgentEndpoint, session: str, reward: float) -> aiohttp.ClientResponse:
    async with aiohttp.ClientSession() as http:
        resp = await http.post(f"{ep.url[:-3]}/rl/sessions/{session}/reward", json={"reward": reward},
                               headers={"Authorization": f"Bearer {ep.config.api_key}"})
        await resp.read()
        return resp


def _script(prompt: str) -> str:
    """Turn k of a session (k = the assistant turns so far): a call to add, a malformed call, a reply."""
    turn = prompt.count("<|im_start|>assistant") - 1
    if turn == 4:
        return '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>'  # malformed JSON
    if turn % 2 == 0:
        return '<tool_call>\n{"name": "add", "arguments": {"a": ' + str(turn) + ', "b": 30}}\n</tool_call>'
    return f"The sum is {turn + 29}."


async def test_eight_turn_sessions_with_tool_calls_train_on_exactly_what_was_sampled() -> None:
    tok = tokenizer(QWEN25, "<|im_end|>")
    engine = ScriptedEngine(_model(tok), tok, _script)
    async with _endpoint(engine, tok) as ep:
        replies = []
        for session in ("s1", "s2"):
            client = _client(ep, session)
            messages: list[dict[str, Any]] = [{"role": "user", "content": "Add 0 and 30, then go on."}]
            for _ in range(8):
                resp = await client.chat.completions.create(model=ep.config.model, messages=messages, tools=TOOLS,
                                                            max_tokens=48, logprobs=True)
                choice = resp.choices[0]
                replies.append((session, choice))
                message = choice.message.model_dump(exclude_none=True)
                messages.append(message)
                if choice.finish_reason == "tool_calls":
                    args = json.loads(choice.message.tool_calls[0].function.arguments)
                    messages.append({"role": "tool", "tool_call_id": choice.message.tool_calls[0].id,
                                     "content": str(args["a"] + args["b"])})
                else:
                    messages.append({"role": "user", "content": "Go on."})
            assert (await _reward(ep, session, 1.0)).status == 200
        finished = ep.take_finished()
        stats = ep.statistics()
    assert [f.session for f in finished] == ["s1", "s2"] and all(f.reward == 1.0 for f in finished)
    assert stats["forks"] == 0 and stats["continued"] == 14 and stats["tool_call_errors"] == 2
    assert stats["tool_calls"] == 6  # turns 0, 2, 6 of each session
    sampled = iter(engine.sampled)
    for f in finished:
        t = f.trajectory
        positions = [i for i, m in enumerate(t.loss_mask) if m]
        got_ids = [t.ids[i] for i in positions]
        got_logprobs = [t.logprobs[i] for i in positions]
        want = [next(sampled) for _ in range(8)]
        # bitwise: the ids and float32 logprobs the engine returned, in order, and nothing else mask 1
        assert got_ids == [i for g in want for i in g.response_ids.tolist()]
        assert got_logprobs == [x for g in want for x in g.logprobs.tolist()]
        assert all(v == 0 for v in (t.versions[i] for i in positions))
        # the mask-0 tokens are the template's and the tools': decoded, they hold every tool result
        context = tok.decode([i for i, m in zip(t.ids, t.loss_mask, strict=True) if not m], skip_special_tokens=False)
        assert context.count("<tool_response>") == 3 and context.count("<|im_start|>assistant\n") == 8
    # the SDK's view of a reply: the tool call parsed, the malformed one as text with its error
    first, malformed = replies[0][1], replies[4][1]
    assert first.finish_reason == "tool_calls" and first.message.tool_calls[0].function.name == "add"
    assert malformed.finish_reason == "stop" and "<tool_call>" in malformed.message.content
    extra = malformed.model_extra["streamrl"]
    assert "not valid JSON" in extra["tool_call_errors"][0] and extra["policy_version"] == 0
    assert len(first.logprobs.content) == len(first.model_extra["streamrl"]["token_ids"])


async def test_concurrent_sessions_batch_and_keep_the_sampled_tokens_bitwise() -> None:
    tok = tokenizer(QWEN25, "<|im_end|>")
    engine = RecordingEngine(_model(tok), tok)
    async with _endpoint(engine, tok) as ep:
        responses: dict[str, list[Any]] = {}

        async def agent(session: str) -> None:
            client = _client(ep, session)
            messages: list[dict[str, Any]] = [{"role": "user", "content": f"Hello {session}"}]
            for _ in range(3):
                resp = await client.chat.completions.create(model=ep.config.model, messages=messages, max_tokens=12)
                responses.setdefault(session, []).append(resp.choices[0])
                messages += [resp.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "?"}]
            await _reward(ep, session, 0.5)

        async with anyio.create_task_group() as tg:
            for k in range(6):
                tg.start_soon(agent, f"a{k}")
        finished = {f.session: f.trajectory for f in ep.take_finished()}
        assert ep.backend.stats.largest_batch > 1  # the sessions' turns shared engine calls
    sampled = {tuple(g.response_ids.tolist()): g for g in engine.sampled}
    for session, choices in responses.items():
        t = finished[session]
        mask_one = [(i, lp) for i, lp, m in zip(t.ids, t.logprobs, t.loss_mask, strict=True) if m]
        from_endpoint = [(i, lp) for c in choices for i, lp in zip(c.model_extra["streamrl"]["token_ids"],
                                                                  c.model_extra["streamrl"]["logprobs"], strict=True)]
        assert mask_one == from_endpoint
        for c in choices:  # each reply's tokens and logprobs are a Generation of the engine, bitwise
            ids = c.model_extra["streamrl"]["token_ids"]
            g = sampled[tuple(ids)]
            assert c.model_extra["streamrl"]["logprobs"] == g.logprobs.tolist()


async def test_a_sessions_replies_do_not_depend_on_the_other_sessions_timing() -> None:
    """Six three-turn sessions played concurrently (their turns batched as they arrive) and then one
    after another on a fresh endpoint of the same seed: each session's replies are the same tokens,
    as each (session, turn, choice) samples from a stream of its own."""
    tok = tokenizer(QWEN25, "<|im_end|>")

    async def play(concurrently: bool) -> tuple[dict[str, list[list[int]]], int]:
        replies: dict[str, list[list[int]]] = {}
        async with _endpoint(RecordingEngine(_model(tok), tok), tok) as ep:
            async def agent(session: str) -> None:
                client = _client(ep, session)
                messages: list[dict[str, Any]] = [{"role": "user", "content": f"Hello {session}"}]
                for _ in range(3):
                    resp = await client.chat.completions.create(model=ep.config.model, messages=messages,
                                                                max_tokens=12, n=2)
                    replies.setdefault(session, []).extend(c.model_extra["streamrl"]["token_ids"]
                                                           for c in resp.choices)
                    messages += [resp.choices[0].message.model_dump(exclude_none=True),
                                 {"role": "user", "content": "?"}]
                await _reward(ep, session, 0.5)

            if concurrently:
                async with anyio.create_task_group() as tg:
                    for k in range(6):
                        tg.start_soon(agent, f"a{k}")
            else:
                for k in range(6):
                    await agent(f"a{k}")
            return replies, ep.backend.stats.largest_batch

    together, largest = await play(concurrently=True)
    one_by_one, alone = await play(concurrently=False)
    assert largest > alone  # the concurrent sessions' turns shared engine calls
    assert together == one_by_one
    assert len({tuple(r) for rs in together.values() for r in rs}) > 6  # and the streams differ


async def test_a_template_that_rewrites_history_forks_and_is_counted() -> None:
    tok = tokenizer(QWEN3, "<|im_end|>")
    engine = ScriptedEngine(_model(tok), tok, lambda prompt: "<think>\nhmm\n</think>\n\n42")
    async with _endpoint(engine, tok) as ep:
        client = _client(ep, "think")
        messages: list[dict[str, Any]] = [{"role": "user", "content": "a"}]
        first = await client.chat.completions.create(model=ep.config.model, messages=messages)
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "b"}]
        second = await client.chat.completions.create(model=ep.config.model, messages=messages)
        assert second.model_extra["streamrl"]["forked"] is True
        assert "rewrites history" in second.model_extra["streamrl"]["fork_reason"]
        await _reward(ep, "think", 0.0)
        finished = ep.take_finished()
        assert ep.statistics()["fork_rate"] == 1.0
    assert len(finished) == 2  # the trajectory it forked from, and the new one


async def test_streaming_answers_in_server_sent_events() -> None:
    tok = tokenizer(QWEN25, "<|im_end|>")
    engine = ScriptedEngine(_model(tok), tok, _script)
    async with _endpoint(engine, tok) as ep:
        stream = await _client(ep, "st").chat.completions.create(
            model=ep.config.model, messages=[{"role": "user", "content": "hi"}], tools=TOOLS, stream=True)
        chunks = [c async for c in stream]
    calls = [tc for c in chunks for ch in c.choices for tc in (ch.delta.tool_calls or [])]
    assert calls and calls[0].function.name == "add"
    assert [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason] == ["tool_calls"]


async def test_bad_requests_get_a_4xx_naming_the_problem_and_the_server_stays_up() -> None:
    tok = tokenizer(QWEN25, "<|im_end|>")
    engine = RecordingEngine(_model(tok), tok)
    async with _endpoint(engine, tok, max_request_bytes=64 << 10, session_idle_s=0.2) as ep:
        url, auth = ep.url, {"Authorization": f"Bearer {ep.config.api_key}"}
        ok_body = {"model": ep.config.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        cases: list[tuple[dict[str, str], bytes, int, str]] = [
            ({}, json.dumps(ok_body).encode(), 401, "run's key"),
            ({"Authorization": "Bearer wrong"}, json.dumps(ok_body).encode(), 401, "run's key"),
            (auth, b"{not json", 400, "not JSON"),
            (auth, json.dumps({**ok_body, "model": "gpt-9"}).encode(), 404, "does not exist"),
            (auth, json.dumps({**ok_body, "max_tokens": 10**9}).encode(), 400, "max_tokens must be in"),
            (auth, json.dumps({**ok_body, "n": "two"}).encode(), 400, "n"),
            (auth, json.dumps({**ok_body, "messages": [{"role": "wizard", "content": "x"}]}).encode(), 400,
             "messages[0].role"),
            (auth, json.dumps({**ok_body, "messages": [{"role": "user", "content": "x" * 3000}] * 30}).encode(), 413,
             "over"),
            (auth, json.dumps({**ok_body, "messages": [{"role": "user", "content": "1 2 " * 1200}]}).encode(), 400,
             "positions"),
        ]
        async with aiohttp.ClientSession() as http:
            for headers, body, status, words in cases:
                resp = await http.post(f"{url}/chat/completions", data=body,
                                       headers={**headers, "Content-Type": "application/json"})
                payload = await resp.json()
                assert resp.status == status and words in payload["error"]["message"], (status, payload)
            # a session that never ends is dropped after session_idle_s; its reward then finds nothing
            client = _client(ep, "idle")
            await client.chat.completions.create(model=ep.config.model, messages=ok_body["messages"], max_tokens=4)
            await anyio.sleep(1.0)
            assert ep.statistics()["sessions_expired"] == 1 and not ep.sessions
            assert (await _reward(ep, "idle", 1.0)).status == 404
        # and it still answers
        resp = await _client(ep).chat.completions.create(model=ep.config.model, messages=ok_body["messages"],
                                                         max_tokens=4)
        assert resp.choices[0].finish_reason in ("stop", "length")
        assert ep.statistics()["bad_requests"] == len(cases) + 1  # + the reward for the expired session
