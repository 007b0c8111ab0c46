"""A user's own stage classes, plugged into pipeline YAML files by ``module:Class`` like built-in ones.

They follow the protocol of :mod:`streamrl.runtime.stage` and nothing else (no base class).
What they see is written to JSON-lines files in the run dir so that a test can check it after
the run, whether the stage ran in a worker process or in the test's own process.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from streamrl.runtime.stage import Batch, ClaimSize, Output, StageContext, StopRun


def _record(ctx: StageContext, name: str, row: dict[str, Any]) -> None:
    with (ctx.run_dir / f"{name}.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")


class CountingSource:
    """Writes ``x`` = 0, 1, 2, ... and ``tag`` = "item-<x>", in groups of ``options.group_size``.

    options: ``n`` samples in all (default 16), ``group_size`` (default 4), ``rewards``: an
    optional list of ``n`` values written as the ``reward`` column (if ``reward`` is in writes),
    ``fail_after``: raise in ``produce`` once more than this many samples were made."""

    async def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.n = int(ctx.options.get("n", 16))
        self.group = int(ctx.options.get("group_size", 4))
        self.rewards = ctx.options.get("rewards")
        self.next = 0

    async def produce(self) -> Output | None:
        if self.next >= self.n:
            return None
        xs = list(range(self.next, min(self.next + self.group, self.n)))
        self.next += len(xs)
        cols: dict[str, list[Any]] = {"x": xs, "tag": [f"item-{x}" for x in xs]}
        if "reward" in self.ctx.spec.writes:
            assert self.rewards is not None, "options.rewards is needed to write 'reward'"
            cols["reward"] = [float(self.rewards[x]) for x in xs]
        if self.next > int(self.ctx.options.get("fail_after", self.n)):
            raise RuntimeError("user source fails")
        return Output(cols, group_size=len(xs))

    async def close(self) -> None:
        pass


class OracleGenerator:
    """A rule-based "generator" in place of the built-in model one: even samples answer right
    (the answer digit, then EOS), odd samples answer wrong with 1-3 repeats of another digit.
    Writes ``response_ids`` (int64 tensors) like the built-in generate stage does."""

    async def setup(self, ctx: StageContext) -> None:
        from streamrl.stages.common import build_tokenizer

        self.ctx = ctx
        self.tok = build_tokenizer(ctx.config)

    async def process(self, batch: Batch) -> dict[str, list[Any]]:
        out = []
        for s, answer in zip(batch.samples, batch.columns["answer"], strict=True):
            if s.index % 2 == 0:
                text = answer
                ids = [*self.tok.convert_tokens_to_ids(list(text)), self.tok.eos_token_id]
            else:
                text = str((int(answer) + 1) % 10) * (1 + s.index % 3)
                ids = self.tok.convert_tokens_to_ids(list(text))
            out.append(torch.tensor(ids, dtype=torch.int64))
        return {"response_ids": out}

    async def close(self) -> None:
        pass


class ResponseLength:
    """A user stage that derives a new column from a built-in one: ``response_len`` (tokens)."""

    async def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx

    async def process(self, batch: Batch) -> dict[str, list[Any]]:
        return {"response_len": [int(t.numel()) for t in batch.columns["response_ids"]]}

    async def close(self) -> None:
        pass


class Recorder:
    """A sink: writes nothing, records every column it reads for every sample to
    ``<run_dir>/<options.file or stage name>.jsonl`` (tensors as lists), and the value of the
    environment variable ``options.environ`` if that is set."""

    async def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.file = str(ctx.options.get("file", ctx.spec.name))

    async def process(self, batch: Batch) -> dict[str, list[Any]]:
        for i, s in enumerate(batch.samples):
            row: dict[str, Any] = {"index": s.index, "group": s.group, "version": s.version,
                                   "worker": self.ctx.worker, "pid": os.getpid()}
            if "environ" in self.ctx.options:  # the worker's value of this environment variable
                row["environ"] = os.environ.get(str(self.ctx.options["environ"]))
            for name, values in batch.columns.items():
                v = values[i]
                row[name] = v.tolist() if hasattr(v, "tolist") else v
            _record(self.ctx, self.file, row)
        return {}

    async def close(self) -> None:
        _record(self.ctx, self.file + ".closed", {"worker": self.ctx.worker})


class ThreadLooker:
    """Writes ``y`` = 2 * ``x``; records, from inside its compute call (``run_sync``), the torch
    threads it got and the host's core-share markers (None: no share directory)."""

    async def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx

    def _look(self) -> dict[str, Any]:
        shm = self.ctx.shm_dir
        cores = shm / "cores" if shm is not None else None
        markers = sorted(os.listdir(cores)) if cores is not None and cores.exists() else None
        return {"threads": torch.get_num_threads(), "markers": markers, "pid": os.getpid()}

    async def process(self, batch: Batch) -> dict[str, list[Any]]:
        _record(self.ctx, f"{self.ctx.spec.name}-threads", await self.ctx.run_sync(self._look))
        return {"y": [2 * int(x) for x in batch.columns["x"]]}

    async def close(self) -> None:
        pass


class Doubler:
    """Writes ``y`` = 2 * ``x``; fails on samples whose ``x`` is in ``options.fail_on`` (a
    ValueError) and kills its own process on those in ``options.die_on`` (``options.how``:
    "exit" = os._exit(3), "kill" = SIGKILL, "segv" = a segmentation fault); sleeps ``options.sleep_s`` per batch. Records each batch
    it got before acting. ``options.figures``: reports the batch's largest ``x`` (``ctx.report_metrics``).

    ``options.crash_worker`` = k: as two ranks of a collective when one dies in native code. Worker k
    crashes (SIGSEGV) in its first batch; every other worker, in its first batch, waits (at most 30 s)
    until worker k's process is gone, then fails as a peer's broken connection does."""

    async def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.fail_on = set(ctx.options.get("fail_on", []))
        self.die_on = set(ctx.options.get("die_on", []))
        self.how = str(ctx.options.get("how", "exit"))
        self.sleep_s = float(ctx.options.get("sleep_s", 0.0))  # per batch: a slow stage
        self.crash_worker = ctx.options.get("crash_worker")
        self.figures = bool(ctx.options.get("figures", False))

    async def process(self, batch: Batch) -> dict[str, list[Any]]:
        xs = [int(x) for x in batch.columns["x"]]
        if self.sleep_s:
            await self.ctx.run_sync(time.sleep, self.sleep_s)
        _record(self.ctx, f"{self.ctx.spec.name}-batches",
                {"worker": self.ctx.worker, "pid": os.getpid(), "indices": batch.indices, "x": xs})
        if self.figures:
            self.ctx.report_metrics({"max_x": max(xs)})
        if self.crash_worker is not None:
            crashed = self.ctx.run_dir / "crashed-worker.pid"
            if self.ctx.worker == self.crash_worker:
                crashed.write_text(str(os.getpid()))
                import faulthandler

                faulthandler._sigsegv()
            await self.ctx.run_sync(_wait_until_gone, crashed, 30.0)
            raise ConnectionResetError(f"Connection reset by peer (worker {self.crash_worker})")
        if self.fail_on & set(xs):
            raise ValueError(f"user stage refuses x in {sorted(self.fail_on & set(xs))}")
        if self.die_on & set(xs):
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.how == "segv":  # as a crash in native code (a CUDA or collective library) does
                import faulthandler

                faulthandler._sigsegv()
            os._exit(3)
        return {"y": [2 * x for x in xs]}

    async def close(self) -> None:
        pass


class Taker:
    """Takes ``options.n`` samples a claim (its own ``claim_size``) and writes nothing, as the
    trainer does: each batch is acked, not put. ``options.stop_after``: raises StopRun in that
    batch (the run's end, as a trainer's last step)."""

    async def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.n = int(ctx.options.get("n", 4))
        self.stop_after = ctx.options.get("stop_after")
        self.batches = 0

    def claim_size(self) -> ClaimSize:
        return ClaimSize(self.n)

    async def process(self, batch: Batch) -> dict[str, list[Any]]:
        self.batches += 1
        _record(self.ctx, f"{self.ctx.spec.name}-batches", {"indices": batch.indices})
        if self.stop_after is not None and self.batches >= int(self.stop_after):
            raise StopRun(f"took {self.batches} batches")
        return {}

    async def close(self) -> None:
        pass


def _wait_until_gone(pid_file: Path, timeout_s: float) -> None:
    """Until the process whose pid ``pid_file`` will hold has exited (gone, or a zombie)."""
    from streamrl.runtime.orphans import process_alive

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pid_file.is_file() and (text := pid_file.read_text()) and not process_alive(int(text)):
            return
        time.sleep(0.01)
    raise TimeoutError(f"no process in {pid_file} ended within {timeout_s:g} s")


class BlocksInAThread:
    """A scorer whose first batch blocks in a worker thread for an hour (a stand-in for a collective
    waiting on a peer that is gone): cancellation cannot stop it. Touches ``<run_dir>/blocked``."""

    async def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx

    async def process(self, batch: Batch) -> dict[str, list[Any]]:
        (self.ctx.run_dir / "blocked").touch()
        await self.ctx.run_sync(time.sleep, 3600.0)
        return {"reward": [0.0] * len(batch)}

    async def close(self) -> None:
        pass


def grpo_with_stage(directory: Path, stage: str, cls: str) -> Path:
    """pipelines/grpo.yaml with stage ``stage``'s class replaced by ``cls``, written to ``directory``."""
    pipeline = yaml.safe_load((Path(__file__).resolve().parents[2] / "pipelines" / "grpo.yaml").read_text())
    for spec in pipeline["stages"]:
        if spec["name"] == stage:
            spec["class"] = cls
    path = directory / f"grpo_with_{stage}.yaml"
    path.write_text(yaml.safe_dump(pipeline))
    return path
