"""The agent stage: multi-turn rollouts by an agent written against the OpenAI API, on the live policy.

Each worker serves an :class:`~streamrl.agents.endpoint.AgentEndpoint` on 127.0.0.1 (an OS-chosen
port, the run's own key), backed by its rollout engine through a
:class:`~streamrl.agents.backend.BatchingBackend`, and runs the agent once per sample of each
micro-batch, all of them at once (their requests are batched together in the engine). The agent
is ``options.rollout``, a ``module:function``::

    async def rollout(client: openai.AsyncOpenAI, sample: dict, **rollout_args) -> float

``client`` is pointed at the endpoint with a session of its own (its API key is
``<run key>:<session>``), so unmodified ``openai`` code works inside it; ``sample`` holds the
columns the stage reads (``prompt``, ``answer``, ...) and ``model``, the model name to send. It
returns the sample's reward, or None when the session was ended with ``POST
/rl/sessions/{id}/reward`` (the reward posted is the sample's). Two built-in rollouts cover the
other ways to write an agent: :func:`streamrl.agents.external.run_process` (any process pointed at
the endpoint, which posts its reward) and :func:`streamrl.agents.gym.run_env` (a ``reset`` /
``step`` environment that the stage drives). The session's last trajectory becomes the sample
(:mod:`streamrl.agents.trajectory`): ``prompt_ids`` are its tokens before the first sampled one,
``response_ids`` the rest, ``loss_mask`` 1 exactly on the tokens the policy sampled (template and
tool / user turns 0), ``rollout_logprobs`` their sampling logprobs (0 where the mask is 0). A
session that forked (its messages stopped extending its tokens) trains on the trajectory of its
last request; the ones it forked away from are counted (``fork_rate``), not trained.

Policy versions come as the generate stage's do, from the placement's
:class:`~streamrl.stages.weight_source.WeightSource`: the worker's own engine fed by the publisher
(placement separate), the colocated train stage's inference weights (``colocate_with: train``), or
the versions the train group sends (``weights_from: train``). ``options.weight_updates``:

- ``between_sessions`` (default): each micro-batch's sessions run on one version new enough for
  its samples (step - ``algo.max_staleness``), held for the whole micro-batch, so every token of a
  trajectory comes from one version (colocated: the train phase waits for the micro-batch;
  disaggregated: the next version's install does).
- ``in_session``: each engine call holds the newest version there is, so a new one goes in
  between two calls (with ``chunk_tokens``, possibly inside a completion) and a session can
  continue on it. Each token keeps the version that sampled it, the sample carries its oldest
  (that is what staleness is measured on, and the trainer's off-policy correction weighs each
  token by its own ``rollout_logprobs``). Admission keeps the bound: no session starts before a
  version new enough for its sample is there.

Per-micro-batch metrics (``agent/<name>``): turns per trajectory, tool calls and malformed ones,
the fork rate, p50 / p99 seconds per turn, sessions per second, trajectories sampled on more than
one version, and the samples of lost sessions replayed or dropped (below).

Lost sessions. In placement separate the stage is restartable: a worker that dies mid-session loses
its sessions, and the dock gives their samples (leased, never acknowledged) to the restarted worker
(the dock's ``returned`` count says which). ``options.lost_sessions``: ``replay`` (default) plays
them again from the start; ``drop`` takes them out of the run (the dock's discard: no later stage
waits for them) and the source makes new samples in their place, which needs
``algo.dynamic_sampling.enabled``. A group with dropped members trains on the others.
"""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import math
import time
from typing import Annotated, Any, Literal

import anyio
import msgspec
import torch
from msgspec import Meta

from streamrl.agents.backend import BatchingBackend
from streamrl.agents.endpoint import AgentEndpoint, EndpointConfig
from streamrl.agents.tool_calls import parse_tool_calls
from streamrl.agents.trajectory import NO_VERSION, Trajectory
from streamrl.config import ConfigError, RunConfig
from streamrl.engines.options import EngineName, GenerateOptions, VllmOptions, check_engine_available
from streamrl.runtime.pipeline import PipelineSpec, StageSpec, import_object
from streamrl.runtime.stage import Batch, Output, StageContext
from streamrl.stages.weight_source import (
    check_weight_links,
    fetches_weights,
    version_needed,
    weight_source_for,
)

AGENT_COLUMNS = ("prompt_ids", "response_ids", "rollout_logprobs", "loss_mask", "reward")  # what it can write
MODEL_NAME = "streamrl-policy"  # the model name the endpoint serves (``sample["model"]``)


class AgentError(RuntimeError):
    """An agent's rollout failed (raised, timed out, returned no reward, or never asked the policy)."""


class AgentOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``options`` of the agent stage (streamrl.stages.agent:AgentStage)."""

    rollout: Annotated[str, Meta(description=(
        "The agent, 'module:function': async def rollout(client, sample, **rollout_args) -> reward"))] = ""
    rollout_args: Annotated[dict[str, Any], Meta(description=(
        "Keyword arguments the rollout function gets (e.g. turns)"))] = msgspec.field(default_factory=dict)
    chat_template: Annotated[str | None, Meta(description=(
        "A Jinja chat template for the tokenizer (null: the tokenizer's own; a built-in tiny model has none)"))] = None
    tool_parser: Annotated[str, Meta(description=(
        "How tool calls are read from replies: hermes, qwen, llama3, or 'module:function'"))] = "hermes"
    max_tokens: Annotated[int, Meta(ge=1, description=(
        "Cap on a request's max_tokens (tokens per turn), and its default"))] = 256
    session_timeout_s: Annotated[float, Meta(gt=0, description=(
        "Seconds one rollout may take; a rollout over it fails the stage"))] = 300.0
    weight_updates: Annotated[Literal["between_sessions", "in_session"], Meta(description=(
        "between_sessions: a version is installed only while no session runs; in_session: as soon as it is "
        "published, tokens keep their own version"))] = "between_sessions"
    chunk_tokens: Annotated[Annotated[int, Meta(ge=1)] | None, Meta(description=(
        "Continuous batching: tokens per request per engine call; a request arriving meanwhile joins at the next "
        "call, and a version installed in_session can land inside a completion (null: a completion is one call)"))] = 32
    batch_window_s: Annotated[float, Meta(ge=0, description=(
        "Seconds a request waits for other sessions' requests to join its engine call"))] = 0.005
    engine: Annotated[EngineName, Meta(description=(
        "builtin: torch, in-process, no extra install; vllm: see docs/vllm.md"))] = "builtin"
    vllm: Annotated[VllmOptions, Meta(description="vLLM engine settings (engine: vllm)")] = VllmOptions()
    lost_sessions: Annotated[Literal["replay", "drop"], Meta(description=(
        "A sample whose session died with its worker: replay plays it again on the restarted worker; drop takes "
        "it out of the run and the source makes another (needs algo.dynamic_sampling.enabled)"))] = "replay"


def check_agent_options(options: dict[str, Any]) -> tuple[AgentOptions, Any]:
    """The options converted, and the rollout function, imported and its signature checked."""
    opts = msgspec.convert(options, AgentOptions)
    if not opts.rollout:
        raise ValueError("options.rollout is required: the agent, 'module:function' (e.g. "
                         "streamrl.tasks.calculator:solve), an async def rollout(client, sample, **rollout_args) -> reward")
    fn = import_object(opts.rollout, "options.rollout", form="module:function", must_call=True)
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"options.rollout {opts.rollout!r} must be an async function: "
                         "async def rollout(client, sample, **rollout_args) -> reward")
    try:
        inspect.signature(fn).bind(None, {}, **opts.rollout_args)
    except TypeError as exc:
        raise ValueError(f"options.rollout_args {opts.rollout_args} do not fit {opts.rollout!r}: {exc}") from None
    parse_tool_calls(opts.tool_parser, "")  # an unknown parser is refused here
    check_engine_available(opts.engine)
    if importlib.util.find_spec("openai") is None:
        raise ValueError("the agent stage gives the agent an openai.AsyncOpenAI client, but the openai package is "
                         "not installed: pip install 'streamrl[agent]' (or pip install openai)")
    return opts, fn


def drops_lost_sessions(spec: StageSpec) -> bool:
    """Its options say ``lost_sessions: drop`` (the stage then discards samples: the source makes up)."""
    return spec.options.get("lost_sessions") == "drop"


class AgentStage:
    Options = AgentOptions  # checked when the pipeline loads
    uses_model_and_task = True
    # placement separate: its sessions live in the worker, and a restarted one plays the leased samples
    # again (a reshard placement's worker is a rank of a torch.distributed world: not restartable)
    restartable = staticmethod(fetches_weights)
    fetches_policy = staticmethod(fetches_weights)  # the trainer's published weights (placement separate)
    # with lost_sessions: drop it takes samples out of the run, for which the source makes up
    # (streamrl.stages.source's dynamic sampling)
    discards = staticmethod(drops_lost_sessions)

    @staticmethod
    def check_options(options: dict[str, Any]) -> None:
        check_agent_options(options)

    @classmethod
    def check_spec(cls, spec: StageSpec, pipeline: PipelineSpec, cfg: RunConfig) -> None:
        check_weight_links(spec, pipeline)
        if drops_lost_sessions(spec) and not cfg.algo.dynamic_sampling.enabled:
            raise ConfigError(f"{pipeline.where}: stage {spec.name!r}: options.lost_sessions: drop takes the samples "
                              "of sessions lost with a worker out of the run, and only the source's dynamic sampling "
                              "makes new ones in their place: set algo.dynamic_sampling.enabled: true, or "
                              "lost_sessions: replay (the default: they are played again)")
        unknown = [c for c in spec.writes if c not in AGENT_COLUMNS]
        missing = [c for c in ("prompt_ids", "response_ids") if c not in spec.writes]
        if unknown or missing:
            raise ConfigError(f"{pipeline.where}: stage {spec.name!r}: an agent stage writes prompt_ids and "
                              f"response_ids and any of {list(AGENT_COLUMNS[2:])}; "
                              + (f"it cannot write {unknown}" if unknown else f"add {missing} to its writes"))

    async def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.opts, self.rollout = check_agent_options(ctx.options)
        # the policy's versions come as the generate stage's would in this placement
        self.weights = weight_source_for(ctx, GenerateOptions(engine=self.opts.engine, vllm=self.opts.vllm))
        await self.weights.setup()
        tokenizer = self.weights.tokenizer
        if self.opts.chat_template is not None:
            tokenizer.chat_template = self.opts.chat_template
        self.backend = BatchingBackend(self.weights, tokenizer.eos_token_id, window_s=self.opts.batch_window_s,
                                       seed=ctx.config.seed * 1000 + 17 * ctx.worker + 1,
                                       chunk_tokens=self.opts.chunk_tokens)
        self.endpoint = AgentEndpoint(self.backend, tokenizer, EndpointConfig(
            model=MODEL_NAME, max_tokens=self.opts.max_tokens, max_positions=self.weights.max_positions,
            tool_parser=self.opts.tool_parser, session_idle_s=self.opts.session_timeout_s))
        self.sessions = itertools.count()
        self.lost = {"replayed": 0, "dropped": 0}  # samples of sessions lost with a worker (process())
        self.closed = anyio.Event()
        self.failure: BaseException | None = None
        ready = anyio.Event()
        ctx.tasks.start_soon(self._serve, ready)  # type: ignore[attr-defined]
        with anyio.fail_after(60):
            await ready.wait()
        if self.failure is not None:
            raise self.failure
        import openai  # checked present by check_options

        self.client = openai.AsyncOpenAI(base_url=self.endpoint.url, api_key=self.endpoint.config.api_key,
                                         max_retries=0, timeout=self.opts.session_timeout_s)
        self.reported = self.endpoint.statistics()
        ctx.log.info("%s[%d]: agent endpoint at %s (%s engine)", ctx.spec.name, ctx.worker, self.endpoint.url,
                     self.weights.engine_name)

    async def _serve(self, ready: anyio.Event) -> None:
        """The endpoint's life, in the worker's task group (it is entered and left in one task)."""
        try:
            async with self.endpoint:
                ready.set()
                await self.closed.wait()
        except Exception as exc:
            self.failure = exc
            ready.set()
            raise

    async def process(self, batch: Batch) -> Output:
        # a sample the dock gave back (its session died with a worker): replayed, or dropped
        lost = [r > 0 for r in batch.returned]
        drop = lost if self.opts.lost_sessions == "drop" else [False] * len(lost)
        if any(lost):  # totals of this worker process (the samples of a dead worker come to its successor)
            self.lost["replayed"] += sum(lost) - sum(drop)
            self.lost["dropped"] += sum(drop)
            self.ctx.report_metrics({f"lost_sessions_{k}": float(v) for k, v in self.lost.items()})
        names = [c for c in batch.columns if not c.endswith("_ids")]
        samples = [{**{c: batch.columns[c][i] for c in names}, "model": MODEL_NAME} for i in range(len(batch.samples))]
        results: list[tuple[Trajectory, float] | None] = [None] * len(samples)  # None: dropped
        if not all(drop):
            need = version_needed(batch, self.ctx.config.algo.max_staleness)
            started = time.perf_counter()
            if self.opts.weight_updates == "between_sessions":
                # one version for every call of the micro-batch's sessions: none is installed under them
                async with self.backend.pinned(need):
                    await self._play_all(samples, results, drop)
            else:
                # admission: no session starts on a version too old for its sample; installs then go in
                # between two engine calls (the backend holds the source per call)
                async with self.weights.hold(need):
                    pass
                await self._play_all(samples, results, drop)
            played = [r for r in results if r is not None]
            assert len(played) == drop.count(False)
            self._report(len(played), time.perf_counter() - started, played)
        return self._output(results, drop)

    async def _play_all(self, samples: list[dict[str, Any]], results: list[tuple[Trajectory, float] | None],
                        drop: list[bool]) -> None:
        async with anyio.create_task_group() as tg:
            for i, sample in enumerate(samples):
                if not drop[i]:
                    tg.start_soon(self._play, i, sample, results)

    async def _play(self, i: int, sample: dict[str, Any], results: list[tuple[Trajectory, float] | None]
                    ) -> None:
        sid = f"{self.ctx.worker}-{next(self.sessions)}"
        client = self.client.with_options(api_key=f"{self.endpoint.config.api_key}:{sid}")
        where = f"options.rollout {self.opts.rollout!r} on sample {i} ({_brief(sample)})"
        try:
            with anyio.fail_after(self.opts.session_timeout_s):
                reward = await self.rollout(client, sample, **self.opts.rollout_args)
        except TimeoutError:
            self.endpoint.end_session(sid, 0.0)
            raise AgentError(f"{where} took over options.session_timeout_s={self.opts.session_timeout_s:g} s"
                             ) from None
        except Exception as exc:
            self.endpoint.end_session(sid, 0.0)
            raise AgentError(f"{where} raised {type(exc).__name__}: {exc}") from exc
        if reward is None:  # the agent ended the session itself: POST /rl/sessions/{id}/reward
            finished = self.endpoint.take_session(sid)
            if not finished and self.endpoint.end_session(sid, 0.0) is not None:
                raise AgentError(f"{where} returned None but its session was not rewarded: return the reward, or "
                                 f"POST {{\"reward\": ...}} to /rl/sessions/{sid}/reward before returning")
        elif isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
            self.endpoint.end_session(sid, 0.0)
            raise AgentError(f"{where} returned {reward!r}; it must return the reward, a finite number (or None "
                             "when it posted the reward to the session's /rl/sessions/{id}/reward)")
        else:
            finished = self.endpoint.end_session(sid, float(reward)) or []
        if not finished:
            raise AgentError(f"{where} returned without a completion from the policy in its session (its client's "
                             "requests carry the session; a client of its own would not)")
        results[i] = (finished[-1].trajectory, finished[-1].reward)

    def _output(self, results: list[tuple[Trajectory, float] | None], drop: list[bool]) -> Output:
        cols: dict[str, list[Any]] = {c: [] for c in AGENT_COLUMNS}
        versions, lengths = [], []
        for result in results:
            if result is None:  # dropped: the worker discards it before it puts anything
                for values in cols.values():
                    values.append(None)
                versions.append(0)
                lengths.append(0)
                continue
            t, reward = result
            first = t.loss_mask.index(1)  # the first token the policy sampled
            cols["prompt_ids"].append(torch.tensor(t.ids[:first], dtype=torch.int64))
            cols["response_ids"].append(torch.tensor(t.ids[first:], dtype=torch.int64))
            cols["rollout_logprobs"].append(torch.tensor(t.logprobs[first:], dtype=torch.float32))
            cols["loss_mask"].append(torch.tensor(t.loss_mask[first:], dtype=torch.int8))
            cols["reward"].append(reward)
            versions.append(min(v for v in t.versions if v != NO_VERSION))  # staleness: its oldest token
            lengths.append(len(t.ids))
        return Output({c: cols[c] for c in self.ctx.spec.writes}, versions=versions, lengths=lengths,
                      discard=drop if any(drop) else None)

    def _report(self, sessions: int, seconds: float, played: list[tuple[Trajectory, float]]) -> None:
        now = self.endpoint.statistics()
        delta = {k: now[k] - self.reported.get(k, 0.0) for k in ("tool_calls", "tool_call_errors", "forks",
                                                                  "continued", "bad_requests")}
        self.reported = now
        turns = [sum(1 for m in t.messages if m.get("role") == "assistant") for t, _ in played]
        mixed = sum(1 for t, _ in played if len({v for v in t.versions if v != NO_VERSION}) > 1)
        self.ctx.report_metrics({
            "turns_per_trajectory": sum(turns) / max(len(turns), 1),
            "tool_calls": delta["tool_calls"], "tool_call_errors": delta["tool_call_errors"],
            "fork_rate": delta["forks"] / max(delta["forks"] + delta["continued"], 1.0),
            "bad_requests": delta["bad_requests"],
            "turn_latency_p50_s": now["turn_latency_p50_s"], "turn_latency_p99_s": now["turn_latency_p99_s"],
            "sessions_per_s": sessions / max(seconds, 1e-9),
            "mixed_version_trajectories": float(mixed),  # sampled on more than one version (in_session)
        })

    async def close(self) -> None:
        if hasattr(self, "closed"):
            self.closed.set()
        client = getattr(self, "client", None)
        if client is not None:
            await client.close()
        weights = getattr(self, "weights", None)
        if weights is not None:  # close() runs after a failed setup too
            await weights.close()


def _brief(sample: dict[str, Any]) -> str:
    shown = {k: v for k, v in sample.items() if k != "model"}
    text = ", ".join(f"{k}={v!r}" for k, v in shown.items())
    return text if len(text) <= 200 else text[:197] + "..."


