"""Colocated generate + train: R processes each host train worker k and generate worker k.

Pipeline (``pipelines/grpo_colocated.yaml``): ``placement: colocated``, the train stage with
``workers: R`` and the generate stage with ``workers: R`` and ``colocate_with: train``. Each of
the R processes:

- joins a gloo (nccl on CUDA) world of R ranks through a FileStore in
  ``<run_dir>/rendezvous/<train stage>`` (rank = worker index);
- trains with torch FSDP2 (the one train stage, :mod:`streamrl.stages.train`: parameters,
  gradients and AdamW moments sharded over the R ranks);
- after every optimizer step reshards the new weights into a full inference copy (T = 1: every
  rank generates with the whole model) bucket by bucket, swaps its training state out to the
  host and publishes the version (:class:`~streamrl.reshard.ColocatedPolicy`);
- generates with those inference weights *in place* (the rollout model's parameters are bound
  to zero-copy views of them for the length of one batch), so the process holds one copy of
  the weights for each phase, not one per stage.

With ``options.engine: vllm`` (T = 1) the process instead runs a vLLM engine (its engine core in a
child process: this process's default torch.distributed group is the train world, and vLLM's
worker makes its own), and each version's gathered buckets stream into its ``load_weights`` as
they complete; vLLM holds the only inference copy. It sleeps through the training phase where the
platform supports it (accelerators); on CPU vLLM refuses sleep mode, so there the swap covers
the trainer only.

Phases alternate on each rank: the train stage claims its share of a step (``batch_size / R``
samples) while the inference weights are still in place, so generation on this rank keeps
feeding the other ranks; an all-reduce of the step's token counts (which every rank needs for
the global normalisation anyway) tells each rank that all R shares were claimed, i.e. all the
generation this step waits for is done. Only then does it swap training back in
(``to_training``) and run its forward/backward passes. Releasing the weights before that could
deadlock: a rank's generator may hold prompts another rank's share still needs.

The train side of this is :class:`streamrl.stages.handover.ColocatedHandOver`, the generate side
:class:`streamrl.stages.weight_source.ColocatedWeights` (of the one generate stage, or of the agent
stage); this module holds what the two stages of one process share (:class:`ColocatedRank`).
Only rank 0 serves version numbers to the source (``PolicyPublisher`` with no weights: in this
placement weights never travel through it) and reports step metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio

from streamrl.reshard import ColocatedPolicy, RankGroups
from streamrl.runtime.pipeline import StageSpec
from streamrl.runtime.stage import StageContext

__all__ = ["ColocatedRank", "ColocatedSetupError", "colocated_rank", "uses_vllm"]

SHARED_KEY = "colocated_rank"


class ColocatedSetupError(RuntimeError):
    """The colocated train stage of this process could not set up its policy (see its own error)."""


@dataclass
class ColocatedRank:
    """What the stages of one colocated process share (``ctx.shared[SHARED_KEY]``)."""

    ready: anyio.Event = field(default_factory=anyio.Event)
    policy: ColocatedPolicy | None = None
    groups: RankGroups | None = None
    error: str | None = None
    # set by the generate stage's close: the train stage destroys the process group only after it
    # (a TP generation group computes over it until its STOP)
    generation_closed: anyio.Event = field(default_factory=anyio.Event)
    # engine: vllm: set once the generate stage has attached its engine to the policy
    engine_attached: anyio.Event = field(default_factory=anyio.Event)


def uses_vllm(generate: StageSpec) -> bool:
    """Whether the colocated generating stage runs vLLM (its options' ``engine``)."""
    return generate.options.get("engine", "builtin") == "vllm"


def colocated_rank(ctx: StageContext) -> ColocatedRank:
    rank = ctx.shared.get(SHARED_KEY)
    if rank is None:
        rank = ctx.shared[SHARED_KEY] = ColocatedRank()
    return rank
