"""The score stage: a reward per completion, in process or from external reward servers.

Options (pipeline ``options:`` or run config ``stages.score.options``), checked by
:meth:`ScoreStage.check_options` in ``setup`` — before the run's first sample — with errors that
name the option:

``backend``: ``inprocess`` (default) or ``zmq``.
``reward`` (inprocess only): ``module:function`` (``f(prompt, response, **metadata) -> float | dict``,
  see docs/reward-protocol.md §11); default: the task's own rule.
``endpoints`` (zmq only, required): reward-server addresses (``tcp://host:port``); several share the load.
``timeout_s``, ``max_in_flight_per_server``, ``max_batch_size``, ``max_attempts``, ``on_bad_reply``
  (fail | retry | default), ``heartbeat_interval_s``, ``heartbeat_timeout_s``, ``no_server_timeout_s``,
  ``curve_client_secret_key``, ``curve_server_public_key`` (zmq only): passed to
  :class:`streamrl.rewards.RewardClient`.
``on_sample_error`` (fail | default) and ``default_score``: what a sample whose reward function
  failed gets (both backends).
``score_key`` / ``score_weights``: how a *map of named scores* becomes the one reward (below).

Named scores (a reward returning ``{"correct": 1.0, "format": 0.5}``). A plain number is always
the reward. For a map:

1. ``score_key: NAME`` — the entry NAME (a map without it fails the run, naming the keys it has);
2. ``score_weights: {NAME: WEIGHT, ...}`` — the weighted sum of those entries (each must be present;
   other entries are ignored);
3. neither set — a map with a single entry is that entry, a map with an entry named ``reward`` is
   that entry; any other map fails the run at its first occurrence, with the names to choose from.

No silent default aggregation (such as the sum of all entries): named scores are usually on
different scales (a 0/1 correctness next to a length in tokens), and summing them would train on
a reward nobody chose.

What each sample carries (docs/reward-protocol.md §3): ``id`` (the dock's global sample index),
``prompt`` (the prompt text), ``response`` (``response_ids`` decoded *without* special tokens:
no pad/EOS text), ``response_ids`` (every sampled id, EOS included when emitted) and
``metadata: {"answer": ...}``. Never ``prompt_ids``. In process the function gets the same fields.
Per-server latency p50/p99, retries and timeouts go to metrics.jsonl as ``score/...``.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from streamrl.algos.shaping import overlong_penalty
from streamrl.config import ConfigError, RunConfig, overlong_buffer_tokens
from streamrl.rewards import InProcessRewardBackend, RewardClient, RewardConfigError, RewardSample
from streamrl.rewards.results import RewardBackend
from streamrl.runtime.pipeline import PipelineSpec, StageSpec
from streamrl.runtime.stage import Batch, StageContext
from streamrl.stages.common import build_task, build_tokenizer


class ScoreOptionsError(RewardConfigError):
    """The score stage's options are invalid, or do not say how to turn named scores into one reward."""


class ScoreOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """``options`` of the score stage (streamrl.stages.score:ScoreStage): where rewards are computed,
    and how a reward that is a map of named scores becomes one number (this module's docstring)."""

    backend: Annotated[Literal["inprocess", "zmq"], Meta(description=(
        "inprocess: the reward function runs in the score worker; zmq: external reward servers "
        "(docs/reward-protocol.md)"))] = "inprocess"
    reward: Annotated[str | None, Meta(description=(
        "Backend inprocess: the reward function as module:function (f(prompt, response, **metadata) -> float | "
        "dict, docs/reward-protocol.md §11); null: the task's own rule"))] = None
    endpoints: Annotated[list[str] | None, Meta(description=(
        "Backend zmq (required): reward-server addresses (tcp://host:port, ipc://path); several share the "
        "load"))] = None
    score_key: Annotated[str | None, Meta(description=(
        "A reward that is a map of named scores: the entry that is the reward (not with score_weights)"))] = None
    score_weights: Annotated[dict[str, float] | None, Meta(description=(
        "A reward that is a map of named scores: the reward is the weighted sum of these entries {name: weight} "
        "(not with score_key)"))] = None
    on_sample_error: Annotated[Literal["fail", "default"], Meta(description=(
        "A sample whose reward function failed: fail stops the run; default gives it default_score"))] = "fail"
    default_score: Annotated[float | dict[str, float] | None, Meta(description=(
        "The score on_sample_error: default (and on_bad_reply: default) gives; null = 0.0"))] = None
    timeout_s: Annotated[float | None, Meta(description=(
        "Per-request deadline (seconds), after which the batch is sent again. Backend zmq only; null = RewardClient's default (30)"))] = None
    max_in_flight_per_server: Annotated[int | None, Meta(description=(
        "Requests outstanding on one server at most. Backend zmq only; null = RewardClient's default (4)"))] = None
    max_batch_size: Annotated[int | None, Meta(description=(
        "Samples per request; larger batches are split and spread. Backend zmq only; null = RewardClient's default (64)"))] = None
    max_attempts: Annotated[int | None, Meta(description=(
        "Requests per batch before the run fails (refusals of a draining server do not count). Backend zmq only; null = RewardClient's default (4)"))] = None
    on_bad_reply: Annotated[Literal["fail", "retry", "default"] | None, Meta(description=(
        "A malformed reply: fail stops the run, retry sends the batch to another server, default scores its "
        "samples with default_score. Backend zmq only; null = RewardClient's default (fail)"))] = None
    heartbeat_interval_s: Annotated[float | None, Meta(description=(
        "Ping period of each server (seconds). Backend zmq only; null = RewardClient's default (1)"))] = None
    heartbeat_timeout_s: Annotated[float | None, Meta(description=(
        "Silence (seconds) after which a server is presumed dead and its requests are retried. Backend zmq only; null = RewardClient's default (10)"))] = None
    no_server_timeout_s: Annotated[float | None, Meta(description=(
        "How long (seconds) a batch may wait with no server able to take it before the run fails. Backend zmq only; null = RewardClient's default "
        "(120)"))] = None
    curve_client_secret_key: Annotated[str | None, Meta(description=(
        "CURVE: path of this client's .key_secret file. Backend zmq only; null = no encryption"))] = None
    curve_server_public_key: Annotated[str | None, Meta(description=(
        "CURVE: path of the servers' public .key file. Backend zmq only"))] = None


#: ScoreOptions fields forwarded to RewardClient as keyword arguments when set.
_CLIENT_ONLY = (
    "timeout_s", "max_in_flight_per_server", "max_batch_size", "max_attempts", "on_bad_reply",
    "heartbeat_interval_s", "heartbeat_timeout_s", "no_server_timeout_s", "curve_client_secret_key",
    "curve_server_public_key",
)  # fmt: skip
_KNOWN = frozenset(ScoreOptions.__struct_fields__)


class ScoreStage:
    restartable = True  # stateless between micro-batches: the launcher may restart a dead worker
    uses_model_and_task = True  # the pre-run checks load the run's tokenizer and task (streamrl.runtime.prerun)

    @classmethod
    def check_spec(cls, spec: StageSpec, pipeline: PipelineSpec, cfg: RunConfig) -> None:
        """Before anything starts (``validate_pipeline``, after :meth:`check_options`): the
        reward servers' addresses, and an in-process reward function imports."""
        at = f"{pipeline.where}: stage {spec.name!r} options"
        _check_endpoints(spec.options.get("endpoints"), at)
        reward = spec.options.get("reward")
        if isinstance(reward, str) and spec.options.get("backend", "inprocess") == "inprocess":
            from streamrl.rewards.function import load_reward_function

            try:  # imports the user's module now rather than in the worker
                load_reward_function(reward)
            except Exception as exc:  # RewardFunctionLoadError, or whatever importing the module raised
                raise ConfigError(f"{at}.reward: {exc}") from None

    @staticmethod
    def check_options(options: dict[str, Any]) -> ScoreOptions:
        """The typed options, or :class:`ScoreOptionsError` naming the bad one. Pure: opens
        nothing, so a config check can call it before anything starts."""
        unknown = sorted(set(options) - _KNOWN)
        if unknown:
            raise ScoreOptionsError(f"score stage: unknown options {unknown}; known: {sorted(_KNOWN)}")
        try:
            opts = msgspec.convert(options, ScoreOptions)
        except msgspec.ValidationError as exc:
            raise ScoreOptionsError(f"score stage: {str(exc).replace('`$.', '`options.')}") from None
        if opts.backend == "zmq":
            if not opts.endpoints:
                raise ScoreOptionsError(
                    "score stage: backend zmq needs options.endpoints: [tcp://HOST:PORT, ...]"
                )
            if opts.reward is not None:
                raise ScoreOptionsError(
                    "score stage: options.reward is the in-process function; with backend zmq the reward "
                    "servers host the function. Remove options.reward (or use backend: inprocess)"
                )
        else:
            misplaced = [name for name in ("endpoints", *_CLIENT_ONLY) if getattr(opts, name) is not None]
            if misplaced:
                raise ScoreOptionsError(
                    f"score stage: options {misplaced} only apply to backend: zmq (reward servers); "
                    "remove them or set options.backend: zmq"
                )
        if opts.score_key is not None and opts.score_weights is not None:
            raise ScoreOptionsError(
                "score stage: set options.score_key (one named score is the reward) or options.score_weights "
                "(a weighted sum of named scores), not both"
            )
        if opts.score_key is not None and not opts.score_key:
            raise ScoreOptionsError("score stage: options.score_key is empty; give the name of a named score")
        if opts.score_weights is not None:
            if not opts.score_weights:
                raise ScoreOptionsError(
                    "score stage: options.score_weights is empty; give {name: weight} for at least one named score"
                )
            bad = {k: w for k, w in opts.score_weights.items() if not math.isfinite(w)}
            if bad:
                raise ScoreOptionsError(f"score stage: options.score_weights {bad} are not finite numbers")
        return opts

    async def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx
        opts = self.check_options(ctx.options)
        self.options = opts
        self.tokenizer = build_tokenizer(ctx.config)
        policy: dict[str, Any] = {"on_sample_error": opts.on_sample_error}
        if opts.default_score is not None:
            policy["default_score"] = opts.default_score
        self.backend: RewardBackend
        if opts.backend == "inprocess":
            if opts.reward:
                fn: Any = opts.reward
            else:
                task = build_task(ctx.config, self.tokenizer)

                def fn(prompt: str, response: str, **meta: Any) -> float:
                    return task.reward(prompt, response, meta.pop("response_ids", []), meta.pop("answer", ""),
                                       **meta)  # fmt: skip

            self.backend = InProcessRewardBackend(fn, **policy)
        else:
            assert opts.endpoints is not None  # check_options
            client_opts = {
                name: getattr(opts, name) for name in _CLIENT_ONLY if getattr(opts, name) is not None
            }
            client = RewardClient(opts.endpoints, **policy, **client_opts)
            await client.start(ctx.tasks)  # type: ignore[attr-defined]  # the worker's task group (worker.py)
            self.backend = client

    async def process(self, batch: Batch) -> dict[str, list[Any]]:
        cols = batch.columns
        ids = [t.tolist() for t in cols["response_ids"]]
        # Rewards judge the text the model wrote, not the tokenizer's pad/EOS markers (a reward
        # comparing "4<eos>" with "4" would be wrong); the ids still carry everything.
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        samples = [
            RewardSample(id=i, prompt=p, response=r, response_ids=rid, metadata={"answer": a})
            for i, p, r, rid, a in zip(batch.indices, cols["prompt"], texts, ids, cols["answer"], strict=True)
        ]
        results = await self.backend.score(samples)
        rewards = []
        named: dict[str, list[float]] = {}
        for res in results:
            if res.score is None:
                raise ValueError(f"sample {res.sample_id}: no score ({res.error})")
            rewards.append(reward_of(res.score, self.options, sample_id=res.sample_id, source=res.source))
            if isinstance(res.score, dict):
                for name, value in res.score.items():
                    named.setdefault(name, []).append(float(value))
        figures = {f"{name}_mean": sum(v) / len(v) for name, v in named.items() if name != "reward"}
        a = self.ctx.config.algo
        if overlong_buffer_tokens(a) > 0:  # DAPO's overlong shaping: part of the reward the advantage sees
            shaped = [overlong_penalty(len(rid), a.max_new_tokens, overlong_buffer_tokens(a), a.overlong_penalty)
                      for rid in ids]
            rewards = [r + s for r, s in zip(rewards, shaped, strict=True)]
            figures["overlong_penalty_mean"] = sum(shaped) / max(len(shaped), 1)
        self._report(figures)
        return {"reward": rewards}

    def _report(self, named_means: dict[str, float]) -> None:
        """The backend's figures, and this batch's mean of each named score (what a weighted
        reward is made of: ``score/math_mean``, ``score/format_mean``)."""
        stats = msgspec.to_builtins(self.backend.statistics())
        flat: dict[str, float] = dict(named_means)
        for key in ("retries", "timeouts", "late_replies", "bad_replies", "defaulted_samples"):
            if isinstance(stats.get(key), (int, float)):
                flat[key] = stats[key]
        for k, server in enumerate(stats.get("servers", []) or []):
            for key in ("latency_p50_ms", "latency_p99_ms", "timeouts", "lost", "disconnects"):
                if isinstance(server.get(key), (int, float)):
                    flat[f"server{k}/{key}"] = server[key]
        for key in ("latency_p50_ms", "latency_p99_ms"):
            if isinstance(stats.get(key), (int, float)):
                flat[key] = stats[key]
        if flat:
            self.ctx.report_metrics(flat)

    async def close(self) -> None:
        await self.backend.aclose()


def reward_of(
    score: float | dict[str, float], options: ScoreOptions, *, sample_id: int, source: str
) -> float:
    """The one reward of a sample's score, by the named-scores rule of the module docstring."""
    if not isinstance(score, dict):
        return float(score)
    names = sorted(score)
    where = f"sample {sample_id}'s reward (from {source or 'the reward function'}) is a map of named scores {names}"
    if options.score_weights is not None:
        missing = sorted(set(options.score_weights) - set(score))
        if missing:
            raise ScoreOptionsError(
                f"score stage: {where} without {missing}, which options.score_weights weights; "
                f"set options.score_weights to weights of {names}"
            )
        return float(sum(weight * score[name] for name, weight in options.score_weights.items()))
    if options.score_key is not None:
        if options.score_key not in score:
            raise ScoreOptionsError(
                f"score stage: {where} without options.score_key={options.score_key!r}; "
                f"set options.score_key to one of {names}"
            )
        return float(score[options.score_key])
    if len(score) == 1:
        return float(next(iter(score.values())))
    if "reward" in score:
        return float(score["reward"])
    raise ScoreOptionsError(
        f"score stage: {where} and it is not said which is the reward: set options.score_key to one of "
        f"{names}, or options.score_weights: {{{', '.join(f'{n}: 1.0' for n in names)}}} for their weighted sum"
    )


# tcp://HOST:PORT with HOST a name, an IPv4 address or [IPv6]; a connect address, so no '*'
_TCP = re.compile(r"^tcp://(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>[0-9]+)$")


def _check_endpoints(endpoints: Any, at: str) -> None:
    """Reward-server addresses the client connects to: ``tcp://HOST:PORT`` or ``ipc://PATH``."""
    if endpoints is None:
        return
    if isinstance(endpoints, str):
        raise ConfigError(f"{at}.endpoints must be a list of addresses, e.g. [{endpoints!r}]")
    if not isinstance(endpoints, list):
        raise ConfigError(f"{at}.endpoints must be a list like [tcp://HOST:PORT, ...], got {endpoints!r}")
    for i, e in enumerate(endpoints):
        bad = f"{at}.endpoints[{i}] {e!r}"
        if not isinstance(e, str):
            raise ConfigError(f"{bad} must be a string like 'tcp://127.0.0.1:5555'")
        if e.startswith("tcp://"):
            m = _TCP.match(e)
            if m is None:
                raise ConfigError(f"{bad} is not tcp://HOST:PORT (e.g. 'tcp://127.0.0.1:5555'; no '*', which "
                                  "only a server binds)")
            if not 1 <= int(m["port"]) <= 65535:
                raise ConfigError(f"{bad}: port {m['port']} is not in 1..65535")
        elif e.startswith(("ipc://", "inproc://")):
            if not e.partition("://")[2]:
                raise ConfigError(f"{bad} has no path after '://'; e.g. 'ipc:///tmp/reward.sock'")
        else:
            raise ConfigError(f"{bad} must start with tcp:// or ipc:// (e.g. 'tcp://127.0.0.1:5555')")
