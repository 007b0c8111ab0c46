"""Generation by a tensor-parallel inference group (T > 1): rank 0 leads, the other ranks follow.

The T generate workers of one inference replica hold one slice each of the fused inference layout
(``spec.inference_plan(T)``) and sample together with
:class:`~streamrl.engines.tp_rollout.TensorParallelRolloutEngine`, whose forward runs collectives
over the replica's ``inference_group`` every layer. So they must work on the same prompts, with
the same policy version, at the same time. Only TP rank 0 (the *leader*) claims from the dock; it
sends the others (the *followers*, ``follows = True`` for the runtime) a command stream over the
inference group, and nothing else ever uses that group:

====================  ===========================================  ===============================
command               header ``int64[4]`` then                     follower does
====================  ===========================================  ===============================
``GENERATE`` (1)      ``[1, version, n, tokens]``, lengths          ``weights.use(version)`` (must be
                      ``int64[n]``, prompt ids ``int64[tokens]``    exactly it), the same ``generate``
``INSTALL`` (2)       ``[2, version, 0, 0]``                        receives its own slice of
                                                                    ``version`` (disaggregated)
``CHANNEL_CLOSED`` 3  ``[3, -1, 0, 0]``                             receives its close header
``STOP`` (4)          ``[4, -1, 0, 0]``                             returns from ``follow``
====================  ===========================================  ===============================

(all ``dist.broadcast`` from the leader). The leader issues commands one at a time (a lock), so a
follower's actions happen in the leader's order:

- a GENERATE is sent under the leader's shared lease on ``version``; the follower takes a lease on
  the same version, so its slice cannot change under the forward pass either;
- disaggregated: each rank receives its slice from its own train rank, but a follower installs a
  version only when the leader says INSTALL, which the leader says from inside its exclusive update
  (no GENERATE in flight). Without this a follower could install v+1 while the leader still
  generates with v, and the group would compute with mixed weights;
- colocated: the slices change only in ``to_inference``, a collective of the whole train group, which
  the leader's rank joins only after its generation is done; the followers keep their slice through
  the training phase (``release_weights_in_training=False``) because a follower cannot know whether
  its leader still has a batch of the old version to generate.

Lock order on the leader, to stay deadlock-free: weights (shared lease or exclusive update) first,
then the command lock.

Shutdown: the leader's ``close`` sends STOP; a follower stopped by the launcher keeps serving
commands in its ``close`` until STOP (bounded), so a leader never waits in a collective for a
follower that left.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from enum import IntEnum
from typing import TYPE_CHECKING, Any

import anyio
import torch
import torch.distributed as dist
from torch import Tensor

from streamrl.engines.rollout import Generation
from streamrl.engines.tp_rollout import TensorParallelRolloutEngine
from streamrl.reshard import DaemonCall, InferenceWeights, RankGroups
from streamrl.reshard.resharder import HEADER_CLOSE
from streamrl.runtime.stage import StageContext
from streamrl.stages.common import worker_generator

if TYPE_CHECKING:  # transformers' model classes take seconds to import; the launcher imports the stages
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger("streamrl.stage.tp_generation")



class Command(IntEnum):
    GENERATE = 1
    INSTALL = 2
    CHANNEL_CLOSED = 3
    STOP = 4

STOP_WAIT_S = 10.0  # how long either side waits for the other at shutdown


class TensorParallelGenerationError(RuntimeError):
    """The ranks of an inference group disagree (e.g. a follower holds another version)."""


class TensorParallelRollout:
    """Generation by the whole group with one version: the leader tells the followers, then joins them."""

    def __init__(self, group: TensorParallelGeneration, tensors: Mapping[str, Tensor], version: int) -> None:
        self.group, self.tensors, self.version = group, tensors, version

    def generate(self, prompts: list[Tensor], *, max_new_tokens: int, temperature: float, top_p: float, top_k: int,
                 generator: torch.Generator | None = None, streams: Sequence[tuple[int, int]] | None = None
                 ) -> list[Generation]:
        a = self.group.ctx.config.algo
        asked = (max_new_tokens, temperature, top_p, top_k)
        if asked != (a.max_new_tokens, a.temperature, a.top_p, a.top_k):
            raise TensorParallelGenerationError(
                f"a TP group samples with the run's algo settings (max_new_tokens, temperature, top_p, top_k) = "
                f"{(a.max_new_tokens, a.temperature, a.top_p, a.top_k)}, not {asked}: its followers run those")
        self.group._send(Command.GENERATE, self.version, prompts)
        return self.group._generate(self.tensors, prompts, generator, streams)  # (only the leader samples)


class TensorParallelGeneration:
    """One generate worker's part of a TP inference group (see the module doc)."""

    def __init__(self, ctx: StageContext, groups: RankGroups, weights: InferenceWeights, model: PreTrainedModel,
                 tokenizer: PreTrainedTokenizerBase) -> None:
        group = groups.inference_group
        if group is None or groups.inference_rank is None:
            raise ValueError("TensorParallelGeneration needs an inference group of T > 1 ranks")
        self.ctx, self.weights, self.group = ctx, weights, group
        self.tp_rank = groups.inference_rank
        self.leader = self.tp_rank == 0
        self.leader_rank = dist.get_global_rank(group, 0)
        T = dist.get_world_size(group)
        self.engine = TensorParallelRolloutEngine(model.config, tokenizer.eos_token_id, tokenizer.pad_token_id,
                                                  group=group, tensor_parallel=T, device=weights.device)
        self.generator = worker_generator(ctx, self.engine.device)  # only the leader's stream is used
        self._commands = anyio.Lock()
        self._pending: DaemonCall[tuple[int, int, list[Tensor]]] | None = None  # follower: command wait
        self.stopped = False

    # -- the command channel (blocking; run in threads) ------------------------------------------------
    def _send(self, command: Command, version: int, prompts: list[Tensor] | None = None) -> None:
        prompts = prompts or []
        lengths = torch.tensor([p.numel() for p in prompts], dtype=torch.int64)
        header = torch.tensor([int(command), version, len(prompts), int(lengths.sum())], dtype=torch.int64)
        dist.broadcast(header, self.leader_rank, group=self.group)
        if prompts:
            dist.broadcast(lengths, self.leader_rank, group=self.group)
            dist.broadcast(torch.cat(prompts), self.leader_rank, group=self.group)

    def _receive(self) -> tuple[int, int, list[Tensor]]:
        header = torch.empty(4, dtype=torch.int64)
        dist.broadcast(header, self.leader_rank, group=self.group)
        command, version, n, tokens = (int(x) for x in header.tolist())
        if command not in tuple(Command):
            raise TensorParallelGenerationError(f"unknown command {command} from the TP group's rank 0")
        prompts: list[Tensor] = []
        if n:
            lengths = torch.empty(n, dtype=torch.int64)
            dist.broadcast(lengths, self.leader_rank, group=self.group)
            ids = torch.empty(tokens, dtype=torch.int64)
            dist.broadcast(ids, self.leader_rank, group=self.group)
            prompts = list(ids.split(lengths.tolist()))
        return command, version, prompts

    def _generate(self, tensors: Mapping[str, Tensor], prompts: list[Tensor],
                  generator: torch.Generator | None = None, streams: Sequence[tuple[int, int]] | None = None
                  ) -> list[Generation]:
        # every rank runs the run's sampling settings: the group's collectives must line up step by step
        a = self.ctx.config.algo
        return self.engine.generate(prompts, weights=tensors, max_new_tokens=a.max_new_tokens,
                                    temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                                    generator=generator or self.generator, streams=streams)

    # -- leader ---------------------------------------------------------------------------------------
    @asynccontextmanager
    async def hold(self, need: int) -> AsyncIterator[TensorParallelRollout]:
        """The leader's side of ``WeightSource.hold``: a shared lease on a version ``>= need`` and the
        command channel, so the group's GENERATE goes out with that version."""
        async with self.weights.use(need) as tensors:
            version = self.weights.version
            assert version is not None
            async with self._commands:
                yield TensorParallelRollout(self, tensors, version)

    async def announce(self, kind: int, version: int) -> None:
        """``WeightReceiver.receive``'s hook on the leader: the followers receive their slices now."""
        async with self._commands:
            command = Command.CHANNEL_CLOSED if kind == HEADER_CLOSE else Command.INSTALL
            await self.ctx.run_sync(self._send, command, version)

    async def stop(self) -> None:
        """The leader's shutdown: the followers' ``follow`` returns (bounded wait for them)."""
        if self.stopped or not self.leader:
            return
        self.stopped = True
        with anyio.move_on_after(STOP_WAIT_S) as scope:
            async with self._commands:
                await DaemonCall(lambda: self._send(Command.STOP, -1), "streamrl-tp-stop").wait()
        if scope.cancelled_caught:
            log.warning("TP rank 0: the followers did not take STOP within %.0f s", STOP_WAIT_S)

    # -- follower -------------------------------------------------------------------------------------
    async def follow(self, receive: Callable[[], Awaitable[Any]] | None = None) -> None:
        """Serve the leader's commands until STOP. ``receive`` installs this rank's next slice
        (disaggregated: ``WeightReceiver.receive``); None where slices change otherwise (colocated)."""
        while not self.stopped:
            if self._pending is None:
                self._pending = DaemonCall(self._receive, "streamrl-tp-command")
            command, version, prompts = await self._pending.wait()
            self._pending = None
            match command:
                case Command.GENERATE:
                    async with self.weights.use(version) as tensors:
                        if self.weights.version != version:
                            raise TensorParallelGenerationError(
                                f"TP rank {self.tp_rank} holds policy version {self.weights.version}, its rank 0 "
                                f"generates with {version}")
                        await self.ctx.run_sync(self._generate, tensors, prompts)
                case Command.INSTALL | Command.CHANNEL_CLOSED:
                    if receive is None:
                        raise TensorParallelGenerationError("INSTALL received where weights are not received")
                    await receive()
                    if command == Command.INSTALL and self.weights.version != version:
                        raise TensorParallelGenerationError(
                            f"TP rank {self.tp_rank} received policy version {self.weights.version}, its rank 0 "
                            f"announced {version}")
                case Command.STOP:
                    self.stopped = True

    async def follow_until_stopped(self, receive: Callable[[], Awaitable[Any]] | None = None,
                                   timeout_s: float = STOP_WAIT_S) -> bool:
        """A follower's shutdown: keep serving until the leader's STOP (at most ``timeout_s``). True
        if it came."""
        with anyio.move_on_after(timeout_s):
            await self.follow(receive)
        return self.stopped
