"""An OpenAI-compatible HTTP endpoint on the live policy (aiohttp), keeping every session's tokens exact.

Routes (OpenAI's wire format; what an unmodified ``openai`` SDK client sends):

- ``POST /v1/chat/completions``: ``messages``, ``n``, ``temperature``, ``top_p``, ``max_tokens`` /
  ``max_completion_tokens``, ``stop``, ``tools`` / ``tool_choice``, ``logprobs``, ``stream`` (server-sent
  events: the completion as one content chunk, then the finish). Other fields are accepted and ignored.
- ``POST /v1/completions``: a plain ``prompt`` (text or token ids); no session.
- ``GET /v1/models``: the one model served.
- ``POST /rl/sessions/{id}/reward``: ``{"reward": float}`` ends session ``id``; its trajectories,
  with the reward, go to :meth:`AgentEndpoint.take_finished`.

**Sessions.** A request belongs to session S when its API key is ``<run key>:S`` or it carries the
header ``X-Session-Id: S``; without either it is one-off. A session's tokens are a
:class:`~streamrl.agents.trajectory.Trajectory`: a request continues the one whose conversation
its messages extend (any of the previous request's ``n`` choices) and forks otherwise
(:mod:`streamrl.agents.trajectory`). The prompt the engine gets is the trajectory's token ids, never
the re-tokenised conversation. Each choice carries the extension field ``streamrl``: its
``token_ids``, ``logprobs``, ``policy_version`` and whether the request forked. Choice k of a
session's t-th request samples from the random stream named (backend seed, S, t, k)
(:class:`~streamrl.agents.backend.BatchingBackend`), so a session's tokens do not depend on the
other sessions' timing: an agent run is reproducible from its seed.

**Tool calls.** With ``tools`` in the request, each reply goes through the configured parser
(:mod:`streamrl.agents.tool_calls`); well-formed calls come back as ``tool_calls``
(``finish_reason: "tool_calls"``), a malformed one as the reply's text, with its error in
``streamrl.tool_call_errors`` and the endpoint's statistics. Nothing the model writes raises.

**Admission and limits.** The server binds 127.0.0.1 (an OS-chosen port) and answers only
requests bearing the run's key (``Authorization: Bearer <key>[:<session>]``): 401 without it.
A body over ``max_request_bytes`` is refused (413), ``max_tokens`` over the cap or a prompt that
with it exceeds the model's positions (400), sessions beyond ``max_sessions`` (429), each with an
OpenAI-style error body naming the field. A session idle for ``session_idle_s`` is dropped (its
trajectories are not trained on; counted as expired).
"""

from __future__ import annotations

import copy
import hmac
import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec
from aiohttp import web

from streamrl.agents.backend import BatchingBackend, Completion
from streamrl.agents.tool_calls import ParsedReply, parse_tool_calls
from streamrl.agents.trajectory import ChatRenderer, Trajectory
from streamrl.engines.rollout import stream_seed
from streamrl.rewards.latency import LatencyWindow

ROLES = ("system", "developer", "user", "assistant", "tool")
SESSION = web.RequestKey("session", str)  # the request's session id ("" = none)
log = logging.getLogger("streamrl.agents.endpoint")


@dataclass
class EndpointConfig:
    model: str = "streamrl-policy"  # the model name clients send (another name is a 404)
    api_key: str = field(default_factory=lambda: secrets.token_urlsafe(24))  # the run's key
    max_tokens: int = 256  # cap on a request's max_tokens (also its default)
    max_positions: int | None = None  # the model's context: prompt + max_tokens must fit
    max_sessions: int = 1024  # sessions open at once
    session_idle_s: float = 600.0  # a session with no request for this long is dropped
    max_request_bytes: int = 4 << 20  # body size
    max_messages: int = 512  # messages per request
    max_n: int = 16  # choices per request
    tool_parser: str = "hermes"  # streamrl.agents.tool_calls: a registered name or module:function


class ChatRequest(msgspec.Struct, kw_only=True):
    """The fields of a chat-completions request the endpoint uses (others are ignored)."""

    model: str
    messages: list[dict[str, Any]]
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stop: str | list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    logprobs: bool | None = None
    stream: bool | None = None


class CompletionRequest(msgspec.Struct, kw_only=True):
    model: str
    prompt: str | list[int]
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    logprobs: int | None = None
    stream: bool | None = None


class RewardRequest(msgspec.Struct, forbid_unknown_fields=True):
    reward: float


class BadRequest(Exception):
    """A request the endpoint refuses: ``status``, an OpenAI error ``type``, the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.kind = status, param, kind


@dataclass
class Session:
    id: str
    candidates: list[Trajectory] = field(default_factory=list)  # the last request's choices
    ended: list[Trajectory] = field(default_factory=list)  # trajectories it forked away from
    last_used: float = field(default_factory=time.monotonic)
    busy: bool = False  # a request of it is being answered
    requests: int = 0  # chat requests answered or in progress: the next one's turn index


@dataclass
class FinishedTrajectory:
    """A trajectory of an ended session, with the session's reward."""

    session: str
    trajectory: Trajectory
    reward: float


@dataclass
class EndpointStatistics:
    requests: int = 0
    bad_requests: int = 0
    completions: int = 0  # choices answered
    forks: int = 0  # continuations that had to start a new trajectory
    continued: int = 0  # continuations that extended one
    tool_calls: int = 0
    tool_call_errors: int = 0
    sessions_ended: int = 0
    sessions_expired: int = 0
    # seconds from a chat request's arrival to its answer, the most recent ones (for percentiles)
    turn_latency: LatencyWindow = field(default_factory=LatencyWindow)

    @property
    def fork_rate(self) -> float:
        return self.forks / max(self.forks + self.continued, 1)


class AgentEndpoint:
    """The HTTP server; ``async with AgentEndpoint(...) as ep:`` serves at ``ep.url`` until exit."""

    def __init__(self, backend: BatchingBackend, tokenizer: Any, config: EndpointConfig | None = None) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.config = config or EndpointConfig()
        self.renderer = ChatRenderer(tokenizer)
        parse_tool_calls(self.config.tool_parser, "")  # an unknown parser fails here, not at the first reply
        self.sessions: dict[str, Session] = {}
        self.finished: list[FinishedTrajectory] = []
        self.stats = EndpointStatistics()
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._tasks: anyio.abc.TaskGroup | None = None

    # ---------------------------------------------------------------- life

    async def __aenter__(self) -> AgentEndpoint:
        self._tasks = await anyio.create_task_group().__aenter__()
        self._tasks.start_soon(self.backend.run)
        self._tasks.start_soon(self._expire_idle)
        app = web.Application(middlewares=[self._errors, self._auth], client_max_size=self.config.max_request_bytes)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/rl/sessions/{session}/reward", self._reward)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}/v1"
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            with anyio.CancelScope(shield=True):  # the port closes even when the server's task is cancelled
                await self._runner.cleanup()
        self.backend.close()
        if self._tasks is not None:
            self._tasks.cancel_scope.cancel()
            await self._tasks.__aexit__(None, None, None)

    def take_session(self, sid: str) -> list[FinishedTrajectory]:
        """The finished trajectories of session ``sid`` (ended by ``POST /rl/sessions/{id}/reward``),
        taken out of :meth:`take_finished`'s list."""
        mine = [f for f in self.finished if f.session == sid]
        if mine:
            self.finished = [f for f in self.finished if f.session != sid]
        return mine

    def take_finished(self) -> list[FinishedTrajectory]:
        """The trajectories of the sessions ended since the last call."""
        out, self.finished = self.finished, []
        return out

    def statistics(self) -> dict[str, float]:
        """The counters, the fork rate, the sessions open, and the p50 / p99 seconds per turn
        (of the most recent chat requests)."""
        s = self.stats
        counts = {k: float(v) for k, v in vars(s).items() if k != "turn_latency"}
        p50, p99 = (s.turn_latency.percentile_ms(q) for q in (50, 99))
        return {**counts, "fork_rate": s.fork_rate, "sessions_open": float(len(self.sessions)),
                "turn_latency_p50_s": (p50 or 0.0) / 1e3, "turn_latency_p99_s": (p99 or 0.0) / 1e3}

    async def _expire_idle(self) -> None:
        while True:
            await anyio.sleep(min(self.config.session_idle_s / 4, 5.0))
            now = time.monotonic()
            for sid in [sid for sid, s in self.sessions.items()
                        if not s.busy and now - s.last_used > self.config.session_idle_s]:
                del self.sessions[sid]
                self.stats.sessions_expired += 1

    # ---------------------------------------------------------------- middleware

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except BadRequest as exc:
            self.stats.bad_requests += 1
            return _error(exc.status, str(exc), exc.param, exc.kind)
        except web.HTTPRequestEntityTooLarge:
            self.stats.bad_requests += 1
            return _error(413, f"the request body is over {self.config.max_request_bytes} bytes", None)
        except web.HTTPException as exc:
            return _error(exc.status, exc.reason, None)
        except Exception as exc:  # a bug, or the engine failing: this request fails, the server goes on
            log.exception("agent endpoint: %s %s failed", request.method, request.path)
            return _error(500, f"the server failed on this request: {type(exc).__name__}: {exc}", None, "server_error")

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        header = request.headers.get("Authorization", "")
        token = header[7:] if header.startswith("Bearer ") else ""
        key, _, session = token.partition(":")
        if not hmac.compare_digest(key.encode(), self.config.api_key.encode()):
            raise BadRequest(401, "this endpoint needs the run's key: Authorization: Bearer <key>[:<session>]",
                             None, "authentication_error")
        request[SESSION] = session or request.headers.get("X-Session-Id") or ""
        return await handler(request)

    # ---------------------------------------------------------------- routes

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.config.model, "object": "model", "created": 0, "owned_by": "streamrl"}]})

    async def _read(self, request: web.Request, schema: type[Any]) -> Any:
        body = await request.read()
        try:
            return msgspec.json.decode(body, type=schema)
        except msgspec.ValidationError as exc:
            text = str(exc)
            param = text.split("`$.", 1)[1].rstrip("`") if "`$." in text else None
            raise BadRequest(400, f"invalid request: {text}", param) from None
        except msgspec.DecodeError as exc:
            raise BadRequest(400, f"the body is not JSON: {exc}") from None

    def _check_common(self, model: str, n: int, temperature: float, top_p: float, max_tokens: int | None) -> int:
        c = self.config
        if model != c.model:
            raise BadRequest(404, f"model {model!r} does not exist here; this endpoint serves {c.model!r}", "model",
                             "model_not_found")
        if not 1 <= n <= c.max_n:
            raise BadRequest(400, f"n must be in [1, {c.max_n}], got {n}", "n")
        if not 0 < temperature <= 100:
            raise BadRequest(400, f"temperature must be in (0, 100], got {temperature}", "temperature")
        if not 0 < top_p <= 1:
            raise BadRequest(400, f"top_p must be in (0, 1], got {top_p}", "top_p")
        tokens = c.max_tokens if max_tokens is None else max_tokens
        if not 1 <= tokens <= c.max_tokens:
            raise BadRequest(400, f"max_tokens must be in [1, {c.max_tokens}] (this endpoint's cap), got {tokens}",
                             "max_tokens")
        return tokens

    def _check_prompt(self, prompt: list[int], max_tokens: int) -> None:
        limit = self.config.max_positions
        if limit is not None and len(prompt) + max_tokens > limit:
            raise BadRequest(400, f"the prompt is {len(prompt)} tokens and max_tokens {max_tokens}: together over the "
                                  f"model's {limit} positions; shorten the conversation or lower max_tokens",
                             "messages")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self.stats.requests += 1
        arrived = time.perf_counter()
        req: ChatRequest = await self._read(request, ChatRequest)
        max_tokens = self._check_common(req.model, req.n, req.temperature, req.top_p,
                                        req.max_completion_tokens or req.max_tokens)
        messages = _check_messages(req.messages, self.config.max_messages)
        stops = _stops(req.stop)
        session = self._session(request[SESSION] or None)
        try:
            cont = None
            for previous in (session.candidates if session is not None and session.candidates else [None]):
                cont = self.renderer.continue_from(previous, messages, req.tools)
                if not cont.forked:
                    break
            assert cont is not None
            prompt = cont.trajectory
            self._check_prompt(prompt.ids, max_tokens)
            if session is not None and session.candidates:
                if cont.forked:
                    self.stats.forks += 1
                    session.ended.extend(session.candidates)
                    session.candidates = []  # (held once: a failure below must not count them twice)
                else:
                    self.stats.continued += 1
            streams = None
            if session is not None:  # each choice of each turn samples from a stream of its own name
                turn, session.requests = session.requests, session.requests + 1
                streams = [stream_seed(self.backend.seed, session.id, turn, k) for k in range(req.n)]
            completions = await _gather(self.backend, prompt.ids, req.n, streams, max_tokens=max_tokens,
                                        temperature=req.temperature, top_p=req.top_p)
            choices, trajectories = [], []
            for index, done in enumerate(completions):
                tools = req.tools if req.tool_choice != "none" else None  # "none": the reply is text
                choice, trajectory = self._choice(index, prompt, done, stops, tools, bool(req.logprobs))
                choice["streamrl"]["forked"] = cont.forked
                choices.append(choice)
                trajectories.append(trajectory)
            if session is not None:
                session.candidates = trajectories
            self.stats.turn_latency.add(time.perf_counter() - arrived)
        finally:
            if session is not None:
                session.busy = False
                session.last_used = time.monotonic()
        body = {"id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion", "created": int(time.time()),
                "model": self.config.model, "choices": choices,
                "usage": _usage(len(prompt.ids), sum(len(c["streamrl"]["token_ids"]) for c in choices)),
                "streamrl": {"session": session.id if session else None, "forked": cont.forked,
                             "fork_reason": cont.reason}}
        if req.stream:
            return await _stream_chat(request, body)
        return web.json_response(body)

    def _choice(self, index: int, prompt: Trajectory, done: Completion, stops: list[str],
                tools: list[dict[str, Any]] | None, want_logprobs: bool) -> tuple[dict[str, Any], Trajectory]:
        ids, logprobs, versions, finish = _cut_at_stop(self.tokenizer, done, stops)
        stop_token = ids[-1] if finish == "stop" and ids and ids[-1] == self.backend.eos_token_id else None
        text = self.tokenizer.decode(ids[:-1] if stop_token is not None else ids, skip_special_tokens=False)
        if stops:
            text = _before_stop(text, stops)
        parsed = parse_tool_calls(self.config.tool_parser, text) if tools else ParsedReply(content=text)
        self.stats.completions += 1
        self.stats.tool_calls += len(parsed.tool_calls)
        self.stats.tool_call_errors += len(parsed.errors)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content if parsed.content or not
                                   parsed.tool_calls else None}
        if parsed.tool_calls:
            message["tool_calls"] = [{"id": f"call_{secrets.token_hex(8)}", "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}}
                                     for c in parsed.tool_calls]
            finish = "tool_calls"
        trajectory = copy.deepcopy(prompt)
        trajectory.append_completion(ids, logprobs, versions, message, stop_token)
        choice: dict[str, Any] = {
            "index": index, "message": message, "finish_reason": finish,
            "logprobs": {"content": _logprob_entries(self.tokenizer, ids, logprobs)} if want_logprobs else None,
            "streamrl": {"token_ids": ids, "logprobs": logprobs, "policy_version": min(versions, default=done.version),
                         "token_versions": versions, "tool_call_errors": parsed.errors},
        }
        return choice, trajectory

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        self.stats.requests += 1
        req: CompletionRequest = await self._read(request, CompletionRequest)
        max_tokens = self._check_common(req.model, req.n, req.temperature, req.top_p, req.max_tokens)
        if isinstance(req.prompt, str):
            prompt = list(self.tokenizer.encode(req.prompt, add_special_tokens=False))
        else:
            vocab = len(self.tokenizer)
            if not req.prompt or not all(0 <= t < vocab for t in req.prompt):
                raise BadRequest(400, f"prompt token ids must be a non-empty list in [0, {vocab})", "prompt")
            prompt = list(req.prompt)
        self._check_prompt(prompt, max_tokens)
        stops = _stops(req.stop)
        completions = await _gather(self.backend, prompt, req.n, None, max_tokens=max_tokens,
                                    temperature=req.temperature, top_p=req.top_p)
        choices = []
        for index, done in enumerate(completions):
            ids, logprobs, versions, finish = _cut_at_stop(self.tokenizer, done, stops)
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            choices.append({"index": index, "text": _before_stop(text, stops) if stops else text,
                            "finish_reason": finish, "logprobs": None,
                            "streamrl": {"token_ids": ids, "logprobs": logprobs,
                                         "policy_version": min(versions, default=done.version),
                                         "token_versions": versions}})
            self.stats.completions += 1
        body = {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion", "created": int(time.time()),
                "model": self.config.model, "choices": choices,
                "usage": _usage(len(prompt), sum(len(c["streamrl"]["token_ids"]) for c in choices))}
        if req.stream:
            raise BadRequest(400, "stream: true is served for /v1/chat/completions only", "stream")
        return web.json_response(body)

    async def _reward(self, request: web.Request) -> web.Response:
        sid = request.match_info["session"]
        req: RewardRequest = await self._read(request, RewardRequest)
        if not -1e6 <= req.reward <= 1e6:  # NaN fails this too
            raise BadRequest(400, f"reward must be a finite number in [-1e6, 1e6], got {req.reward}", "reward")
        trajectories = self.end_session(sid, req.reward)
        if trajectories is None:
            raise BadRequest(404, f"no open session {sid!r} (never opened, already rewarded, or expired after "
                                  f"{self.config.session_idle_s:.0f} s idle)", "session", "not_found_error")
        self.finished.extend(trajectories)
        return web.json_response({"session": sid, "trajectories": len(trajectories)})

    def end_session(self, sid: str, reward: float) -> list[FinishedTrajectory] | None:
        """End session ``sid`` with ``reward``: its trajectories with sampled tokens, those it forked
        away from first and its last request's choices last (None: no such open session)."""
        session = self.sessions.pop(sid, None)
        if session is None:
            return None
        self.stats.sessions_ended += 1
        return [FinishedTrajectory(sid, t, reward) for t in [*session.ended, *session.candidates] if t.sampled_tokens]

    def _session(self, sid: str | None) -> Session | None:
        if sid is None:
            return None
        if len(sid) > 128 or not sid.isprintable():
            raise BadRequest(400, "a session id is at most 128 printable characters", "session")
        session = self.sessions.get(sid)
        if session is None:
            if len(self.sessions) >= self.config.max_sessions:
                raise BadRequest(429, f"{len(self.sessions)} sessions are open, the endpoint's max_sessions: end one "
                                      "(POST /rl/sessions/{id}/reward) or wait", "session", "rate_limit_exceeded")
            session = self.sessions[sid] = Session(sid)
        if session.busy:
            raise BadRequest(409, f"session {sid!r} has a request in progress; a session's turns come one at a time",
                             "session")
        session.busy = True
        return session


# ---------------------------------------------------------------- helpers

def _error(status: int, message: str, param: str | None, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": None}},
                             status=status)


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _check_messages(messages: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    """Messages as the chat template takes them: a known role each, text content (a list of text
    parts is joined), tool calls as OpenAI writes them."""
    if not messages:
        raise BadRequest(400, "messages must hold at least one message", "messages")
    if len(messages) > limit:
        raise BadRequest(400, f"{len(messages)} messages: this endpoint takes at most {limit}", "messages")
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in ROLES:
            raise BadRequest(400, f"messages[{i}].role must be one of {list(ROLES)}, got {role!r}", f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BadRequest(400, f"messages[{i}].content: only text parts are served", f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        elif content is not None and not isinstance(content, str):
            raise BadRequest(400, f"messages[{i}].content must be a string, a list of text parts or null",
                             f"messages[{i}].content")
        calls = m.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(
                isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
                for c in calls)):
            raise BadRequest(400, f"messages[{i}].tool_calls must be a list of {{function: {{name, arguments}}}}",
                             f"messages[{i}].tool_calls")
        msg = {k: v for k, v in m.items() if k in ("role", "name", "tool_call_id", "tool_calls")}
        msg["content"] = content
        out.append(msg)
    return out


def _stops(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest(400, "stop must be a non-empty string or a list of at most 4", "stop")
    return stops


def _before_stop(text: str, stops: list[str]) -> str:
    cut = min((text.find(s) for s in stops if s in text), default=-1)
    return text if cut < 0 else text[:cut]


def _cut_at_stop(tokenizer: Any, done: Completion, stops: list[str]
                 ) -> tuple[list[int], list[float], list[int], str]:
    """The completion's tokens, logprobs and versions up to the first token that completes a stop
    string (the agent never sees text past it, so the trajectory does not hold it either)."""
    ids, logprobs, versions, finish = done.ids, done.logprobs, done.versions, done.finish_reason
    if stops:
        for k in range(1, len(ids) + 1):
            text = tokenizer.decode(ids[:k], skip_special_tokens=False)
            if any(s in text for s in stops):
                return ids[:k], logprobs[:k], versions[:k], "stop"
    return ids, logprobs, versions, finish


def _logprob_entries(tokenizer: Any, ids: list[int], logprobs: list[float]) -> list[dict[str, Any]]:
    out = []
    for i, lp in zip(ids, logprobs, strict=True):
        token = tokenizer.decode([i], skip_special_tokens=False)
        out.append({"token": token, "logprob": lp, "bytes": list(token.encode()), "top_logprobs": []})
    return out


async def _gather(backend: BatchingBackend, prompt: list[int], n: int, streams: list[int] | None,
                  **kwargs: Any) -> list[Completion]:
    """``n`` completions of one prompt, asked together (they batch); ``streams``: each one's seed."""
    results: list[Completion | None] = [None] * n

    async def one(k: int) -> None:
        results[k] = await backend.complete(prompt, stream=None if streams is None else streams[k], **kwargs)

    async with anyio.create_task_group() as tg:
        for k in range(n):
            tg.start_soon(one, k)
    return [r for r in results if r is not None]


async def _stream_chat(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    """``stream: true``: the answer as chat.completion.chunk events (role, then content and tool
    calls, then the finish), then ``data: [DONE]``."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    base = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"], "model": body["model"]}

    async def send(choices: list[dict[str, Any]], **extra: Any) -> None:
        await response.write(b"data: " + json.dumps({**base, "choices": choices, **extra}).encode() + b"\n\n")

    for c in body["choices"]:
        m = c["message"]
        await send([{"index": c["index"], "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        delta: dict[str, Any] = {"content": m["content"]} if m["content"] else {}
        if m.get("tool_calls"):
            delta["tool_calls"] = [{**tc, "index": k} for k, tc in enumerate(m["tool_calls"])]
        if delta:
            await send([{"index": c["index"], "delta": delta, "logprobs": c["logprobs"], "finish_reason": None}])
        await send([{"index": c["index"], "delta": {}, "finish_reason": c["finish_reason"]}],
                   streamrl={**body["streamrl"], **c["streamrl"]})
    await send([], usage=body["usage"])
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
