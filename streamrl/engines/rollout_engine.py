"""The one interface every rollout engine implements, and how a generate stage picks one.

A generate stage (every placement) talks to :class:`RolloutEngine` only:

- ``generate(prompts, ...)``: one completion per prompt, with the sampled tokens' logprobs;
- ``load_weights(named_tensors)``: install a new policy version in place (Hugging Face parameter
  names; the iterable may be a generator that yields tensors as they arrive, e.g. the reshard's
  buckets, so no second full copy is needed);
- ``close()``: stop the engine and everything it started.

Two engines implement it: the built-in torch engine (:mod:`streamrl.engines.rollout`, the default:
in-process, no extra install) and vLLM (:mod:`streamrl.engines.vllm_engine`, imported only when a
stage asks for it). Stages select one with ``options.engine: builtin | vllm``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from streamrl.engines.rollout import Generation


class RolloutEngine(Protocol):
    name: str
    startup_s: float  # seconds from construction to ready (reported as the stage's engine_startup_s)
    # load_weights copies within this process and waits on no other (a stage may then run a brief
    # install on its event loop: StageContext.run_brief)
    load_weights_is_local: bool

    @property
    def generator_device(self) -> torch.device:
        """Where the ``generator`` passed to ``generate`` must live."""
        ...

    def generate(
        self, prompts: list[Tensor], *, max_new_tokens: int, temperature: float, top_p: float, top_k: int,
        generator: torch.Generator, streams: Sequence[tuple[int, int]] | None = None,
    ) -> list[Generation]:
        """One completion per prompt. ``generator`` decides the random draws: the same generator
        state, weights and prompts give the same tokens. ``streams``: each prompt's own random
        stream instead, a (seed, index of its first draw) pair: its tokens then do not depend on the
        other prompts of the call (the built-in engine draws its k-th token at that index + k with
        :func:`~streamrl.engines.rollout.stream_uniforms`; vLLM seeds the request from the pair)."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Install every parameter of a new policy version (Hugging Face names), in place."""
        ...

    def close(self) -> None: ...


class EngineRollout:
    """An engine with the policy version it holds: what a weight source's ``hold`` yields when the
    engine owns its weights (see :mod:`streamrl.stages.weight_source`)."""

    def __init__(self, engine: RolloutEngine, version: int) -> None:
        self.engine, self.version = engine, version

    def generate(self, prompts: list[Tensor], **sampling: Any) -> list[Generation]:
        return self.engine.generate(prompts, **sampling)
