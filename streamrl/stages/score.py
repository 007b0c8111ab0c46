"""The score stage: a reward per completion, in process or from external reward servers.

Options (pipeline ``options:`` or run config ``stages.score.options``):

``backend``: ``inprocess`` (default) or ``zmq``.
``reward``: ``module:function`` (``f(prompt, response, **metadata) -> float | dict``, see
  docs/reward-protocol.md); default for ``inprocess``: the task's own rule.
``endpoints``: reward-server addresses for ``zmq`` (``tcp://host:port``); several share the load.
``timeout_s``, ``max_in_flight_per_server``, ``on_bad_reply`` (fail | retry | default),
``on_sample_error`` (fail | default), ``default_score``, ``curve_client_secret_key``,
``curve_server_public_key``: passed to :class:`streamrl.rewards.RewardClient`.
``score_key``: which entry of a dict of named scores is the reward (default ``reward``).

Each sample is sent with its prompt, response (text and ids) and metadata ``{"answer": ...}``.
Per-server latency p50/p99, retries and timeouts go to metrics.jsonl as ``score/...``.
"""

from __future__ import annotations

from typing import Any

from streamrl.rewards import InProcessRewardBackend, RewardClient, RewardSample
from streamrl.runtime.stage import Batch, StageContext
from streamrl.stages.common import build_task, build_tokenizer

_CLIENT_OPTIONS = ("timeout_s", "max_in_flight_per_server", "on_bad_reply", "on_sample_error", "default_score",
                   "max_attempts", "curve_client_secret_key", "curve_server_public_key", "max_batch_size")
_KNOWN = {"backend", "reward", "endpoints", "score_key", *_CLIENT_OPTIONS}


class ScoreStage:
    async def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx
        opts = ctx.options
        unknown = sorted(set(opts) - _KNOWN)
        if unknown:
            raise ValueError(f"score stage: unknown options {unknown}; known: {sorted(_KNOWN)}")
        self.tokenizer = build_tokenizer(ctx.config)
        self.score_key = str(opts.get("score_key", "reward"))
        backend = opts.get("backend", "inprocess")
        self.backend: Any
        if backend == "inprocess":
            if opts.get("reward"):
                fn: Any = opts["reward"]
            else:
                task = build_task(ctx.config, self.tokenizer)

                def fn(prompt: str, response: str, **meta: Any) -> float:
                    return task.reward(prompt, response, meta.pop("response_ids", []), meta.pop("answer", ""),
                                       **meta)

            self.backend = InProcessRewardBackend(fn, on_sample_error=opts.get("on_sample_error", "fail"))
        elif backend == "zmq":
            endpoints = opts.get("endpoints")
            if not endpoints or not isinstance(endpoints, list):
                raise ValueError("score stage: backend zmq needs options.endpoints: [tcp://HOST:PORT, ...]")
            client_opts = {k: opts[k] for k in _CLIENT_OPTIONS if k in opts}
            self.backend = RewardClient(endpoints, **client_opts)
            await self.backend.start(ctx.tasks)  # type: ignore[attr-defined]
        else:
            raise ValueError(f"score stage: options.backend must be 'inprocess' or 'zmq', got {backend!r}")

    async def process(self, batch: Batch) -> dict[str, list[Any]]:
        cols = batch.columns
        ids = [t.tolist() for t in cols["response_ids"]]
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=False)
        samples = [
            RewardSample(id=i, prompt=p, response=r, response_ids=rid, metadata={"answer": a})
            for i, p, r, rid, a in zip(batch.indices, cols["prompt"], texts, ids, cols["answer"], strict=True)
        ]
        results = await self.backend.score(samples)
        rewards = []
        for res in results:
            score = res.score
            if isinstance(score, dict):
                if self.score_key not in score:
                    raise ValueError(f"sample {res.sample_id}: the reward server ({res.source}) returned named "
                                     f"scores {sorted(score)} without {self.score_key!r} (set options.score_key)")
                score = score[self.score_key]
            if score is None:
                raise ValueError(f"sample {res.sample_id}: no score ({res.error})")
            rewards.append(float(score))
        self._report()
        return {"reward": rewards}

    def _report(self) -> None:
        import msgspec

        stats = msgspec.to_builtins(self.backend.statistics())
        flat: dict[str, float] = {}
        for key in ("retries", "timeouts", "late_replies", "bad_replies", "defaulted_samples"):
            if isinstance(stats.get(key), (int, float)):
                flat[key] = stats[key]
        for k, server in enumerate(stats.get("servers", []) or []):
            for key in ("latency_p50_ms", "latency_p99_ms", "timeouts", "lost"):
                if isinstance(server.get(key), (int, float)):
                    flat[f"server{k}/{key}"] = server[key]
        for key in ("latency_p50_ms", "latency_p99_ms"):
            if isinstance(stats.get(key), (int, float)):
                flat[key] = stats[key]
        if flat:
            self.ctx.report_metrics(flat)

    async def close(self) -> None:
        await self.backend.aclose()
