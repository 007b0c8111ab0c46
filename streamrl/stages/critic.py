"""PPO's critic as two stages in one process: ``critic`` trains the value model, ``value`` computes
per-token values with it (``colocate_with: critic``, pipelines/ppo.yaml).

    generate -> value (values) -> advantage (gae: advantage, returns) -> train (the policy)
                                                                    \\-> critic (the value model)

The two share the critic's engine (:class:`~streamrl.engines.critic.FSDPCriticEngine`, FSDP2 with
its own AdamW, ``algo.critic``) through ``ctx.shared``, so values always come from the critic's
current weights with no weight transfer. A value is computed only once the critic has trained as
many steps as the policy that generated the sample had (``critic version >= sample version``):
in synchronous mode (``max_staleness: 0``) the values of step s come from the critic trained on
steps 0..s-1, as in PPO. The engine is used by one stage at a time (a lock): a value forward
between two of the critic's micro-batches leaves their accumulated gradients alone.

One worker (``max_workers = 1``): every FSDP2 forward is a collective, and the value stage of
each rank would claim its own micro-batches, so R > 1 critic ranks would wait in each other's
collectives. The critic is a small share of a step's compute next to generation.

Checkpoints: with ``output.checkpoint_every: N`` the critic saves its weights and AdamW after
every N-th step (DCP, :mod:`streamrl.engines.checkpoint`) into ``<run_dir>/critic/step-XXXXXXXX``
(written as ``.partial`` and renamed, as the run's checkpoints); a resume loads the one of the
policy checkpoint's step. Where that is missing (a checkpoint saved on SIGTERM between two
periodic ones, or a crash between the two saves) it loads the newest older one and warns: the
run continues, but not exactly as an uninterrupted one would.
"""

from __future__ import annotations

import logging
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import anyio
import msgspec
import torch.distributed as dist
from msgspec import Meta

from streamrl.config import ConfigError, RunConfig
from streamrl.engines.schedule import lr_scheduler
from streamrl.runtime.checkpoints import checkpoint_name, fsync_tree
from streamrl.runtime.pipeline import NoOptions, PipelineSpec, StageSpec, import_stage_class
from streamrl.runtime.stage import Batch, ClaimSize, StageContext
from streamrl.stages.common import build_policy, step_claim
from streamrl.stages.world import default_backend, join_world, rank_device

if TYPE_CHECKING:  # the engine is the workers' (imported where used): the launcher imports the stages
    from streamrl.engines.critic import FSDPCriticEngine

log = logging.getLogger("streamrl.stage.critic")

SHARED_KEY = "streamrl.critic"
CRITIC_DIR = "critic"  # <run_dir>/critic/step-XXXXXXXX: the critic's checkpoints


@dataclass
class CriticShared:
    """What the critic and value stages of one process share (``ctx.shared[SHARED_KEY]``)."""

    ready: anyio.Event = field(default_factory=anyio.Event)  # the engine is built (or failed: error)
    engine: FSDPCriticEngine | None = None
    error: str | None = None
    version: int = 0  # optimizer steps the critic has taken
    lock: anyio.Lock = field(default_factory=anyio.Lock)  # one user of the engine at a time
    stepped: anyio.Event = field(default_factory=anyio.Event)  # set (and replaced) at every step


def critic_shared(ctx: StageContext) -> CriticShared:
    shared = ctx.shared.get(SHARED_KEY)
    if shared is None:
        shared = ctx.shared[SHARED_KEY] = CriticShared()
    return shared


class CriticOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``options`` of the critic stage (streamrl.stages.critic:CriticStage)."""

    collective_timeout_s: Annotated[float, Meta(gt=0, description=(
        "Seconds a collective of the critic's torch.distributed group may wait"))] = 600.0
    backend: Annotated[str | None, Meta(description=(
        "torch.distributed backend (gloo, nccl, hccl); null: gloo on CPU, nccl on CUDA, hccl on NPU"))] = None


class CriticStage:
    """Trains the value model on ``values`` (the ones the advantages used: the clip's anchor) and
    ``returns`` (GAE's targets), one optimizer step per ``batch_size`` samples; writes nothing."""

    Options = CriticOptions
    max_workers = 1  # see the module doc
    uses_model_and_task = True  # the critic is built from the run's model (streamrl.runtime.prerun)

    @classmethod
    def check_spec(cls, spec: StageSpec, pipeline: PipelineSpec, cfg: RunConfig) -> None:
        at = f"{pipeline.where}: stage {spec.name!r}"
        missing = [c for c in ("prompt_ids", "response_ids", "values", "returns") if c not in spec.reads]
        if missing:
            raise ConfigError(f"{at}: the critic trains on prompt_ids, response_ids, values and returns; add "
                              f"{missing} to its reads (pipelines/ppo.yaml)")
        if not any(s.colocate_with == spec.name and import_stage_class(s.cls) is ValueStage
                   for s in pipeline.stages):
            raise ConfigError(f"{at}: no value stage (streamrl.stages.critic:ValueStage) says `colocate_with: "
                              f"{spec.name}`, so nothing computes values with this critic (pipelines/ppo.yaml)")

    async def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.shared = critic_shared(ctx)
        try:
            await self._setup(ctx)
        except BaseException as exc:
            self.shared.error = f"{type(exc).__name__}: {exc}"
            self.shared.ready.set()  # the value stage of this process stops waiting and fails too
            raise

    async def _setup(self, ctx: StageContext) -> None:
        from streamrl.engines.critic import FSDPCriticEngine
        from streamrl.engines.fsdp import FSDPOptions
        from streamrl.models.value import CausalLMValueModel

        cfg, c = ctx.config, ctx.config.algo.critic
        options = msgspec.convert(ctx.options, CriticOptions)
        backend = options.backend or default_backend(ctx.device)
        device = rank_device(ctx.device, 0, 1, backend)
        # its own world of one (its own rendezvous): the policy's train group never waits for it
        await join_world(ctx, ctx.spec.name, 0, 1, None, backend=backend, timeout_s=options.collective_timeout_s,
                         device=device)
        lm, _ = build_policy(cfg, device, for_training=True)

        def build() -> FSDPCriticEngine:
            model = CausalLMValueModel(lm, seed=cfg.seed)
            return FSDPCriticEngine(model, lr=c.lr, betas=(c.betas[0], c.betas[1]), weight_decay=c.weight_decay,
                                    max_grad_norm=c.max_grad_norm, device=device,
                                    options=FSDPOptions(dtype=cfg.model.dtype))

        self.engine = await ctx.run_sync(build)
        # the policy's schedule shape (algo.lr_schedule, warmup_steps, total_steps) on the critic's own lr
        self.lr_schedule = lr_scheduler(self.engine.optimizer, cfg.algo)
        self.version = 0
        if ctx.resume is not None:
            self.version = await ctx.run_sync(self._load, Path(ctx.resume.path), ctx.resume.state.version)
            with warnings.catch_warnings():  # replayed, not stepped after optimizer steps: torch warns
                warnings.simplefilter("ignore")
                for _ in range(self.version):  # the schedules are functions of the step: replay is exact
                    self.lr_schedule.step()
        self.consumed = 0
        self.shared.engine, self.shared.version = self.engine, self.version
        self.shared.ready.set()

    def claim_size(self) -> ClaimSize:
        a = self.ctx.config.algo
        return step_claim(self.ctx.spec.micro_batch, self.ctx.config.batch_size - self.consumed, self.version,
                          a.max_staleness)

    async def process(self, batch: Batch) -> dict[str, list[Any]]:
        cols, clip = batch.columns, self.ctx.config.algo.critic.value_clip
        async with self.shared.lock:
            await self.ctx.run_sync(self.engine.accumulate_values, cols["prompt_ids"], cols["response_ids"],
                                    cols["values"], cols["returns"], clip, cols.get("loss_mask"))
        self.consumed += len(batch.samples)
        if self.consumed >= self.ctx.config.batch_size:
            await self._step()
        return {}

    async def _step(self) -> None:
        async with self.shared.lock:
            stats = await self.ctx.run_sync(self.engine.step)
        self.lr_schedule.step()
        self.version += 1
        self.consumed = 0
        shared = self.shared
        shared.version = self.version
        shared.stepped.set()  # wakes the value stage's waits; the next step gets a fresh event
        shared.stepped = anyio.Event()
        # joins the policy's step rows as critic/<name> (the critic's own step may lag by one row)
        self.ctx.report_metrics({"value_loss": stats["loss"], "value_clip_fraction": stats["clip_fraction"],
                                 "grad_norm": stats["grad_norm"], "lr": stats["lr"], "version": float(self.version)})
        every = self.ctx.config.output.checkpoint_every
        if every and self.version % every == 0:
            async with self.shared.lock:
                await self.ctx.run_sync(self._save)

    # --- checkpoints ---------------------------------------------------------------------------
    def _save(self) -> None:
        """The critic's weights and AdamW after step ``version``, renamed into place once complete."""
        from streamrl.engines.checkpoint import save_checkpoint

        root = self.ctx.run_dir / CRITIC_DIR
        final = root / checkpoint_name(self.version)
        partial = final.with_name(final.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        save_checkpoint(self.engine, partial)
        fsync_tree(partial)
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        keep = self.ctx.config.output.keep_checkpoints
        for old in sorted(p for p in root.iterdir() if p.name.startswith("step-") and
                          not p.name.endswith(".partial"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)

    def _load(self, checkpoint: Path, version: int) -> int:
        """Load the critic of step ``version`` (the policy checkpoint's), or the newest older one
        (warned: not an exact resume); returns the critic's step."""
        from streamrl.engines.checkpoint import load_checkpoint

        root = checkpoint.parent.parent / CRITIC_DIR
        found = sorted(p for p in root.glob("step-*") if not p.name.endswith(".partial")
                       and int(p.name.removeprefix("step-")) <= version) if root.is_dir() else []
        if not found:
            log.warning("critic: no critic checkpoint at or before step %d in %s; the critic starts afresh "
                        "(the policy resumes from %s)", version, root, checkpoint)
            return 0
        path = found[-1]
        if path.name != checkpoint_name(version):
            log.warning("critic: no critic checkpoint of step %d (the policy's); resuming the critic from %s",
                        version, path)
        steps = load_checkpoint(self.engine, path)
        log.info("critic: resumed from %s at step %d", path, steps)
        return steps

    async def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class ValueStage:
    """Per-token ``values`` of each response under the colocated critic's current weights."""

    Options = NoOptions
    max_workers = 1  # = the critic's workers (colocated)

    @classmethod
    def check_spec(cls, spec: StageSpec, pipeline: PipelineSpec, cfg: RunConfig) -> None:
        host = next((s for s in pipeline.stages if s.name == spec.colocate_with), None)
        if host is None or import_stage_class(host.cls) is not CriticStage:
            raise ConfigError(f"{pipeline.where}: stage {spec.name!r}: the value stage computes with the critic's "
                              "engine in its process: set `colocate_with:` to the critic stage "
                              "(streamrl.stages.critic:CriticStage), as pipelines/ppo.yaml does")

    async def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.shared = critic_shared(ctx)
        await self.shared.ready.wait()
        if self.shared.error is not None or self.shared.engine is None:
            raise RuntimeError(f"the critic stage of this process failed to set up: {self.shared.error}")
        self.engine = self.shared.engine

    async def process(self, batch: Batch) -> dict[str, list[Any]]:
        # values from a critic that has trained as many steps as the policy that sampled the batch
        needed = max(batch.versions, default=0)
        while self.shared.version < needed:
            await self.shared.stepped.wait()
        cols = batch.columns
        async with self.shared.lock:
            values = await self.ctx.run_sync(self.engine.values, cols["prompt_ids"], cols["response_ids"])
        return {"values": values}

    async def close(self) -> None:
        pass
