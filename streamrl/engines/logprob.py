"""Response-token logprobs of a frozen causal LM in one process (the reference policy).

The module's own forward with shared prompts packed (:mod:`streamrl.engines.packing`), so any
Hugging Face causal LM works; the train engine computes its logprobs the same way, so a
reference built from the same weights gives the trainer's numbers.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from streamrl.engines.core_share import rebalance_at_layers
from streamrl.engines.packing import DEFAULT_MAX_ROW_TOKENS, ForwardPath, ResponseForward
from streamrl.engines.samples import TrainBatchError, TrainSample, check_sample
from streamrl.models.device import resolve_device

log = logging.getLogger("streamrl.engine.logprob")


class LogprobEngine:
    """Scores responses under a model held in this process, no gradient."""

    def __init__(self, model: nn.Module, *, device: str | torch.device = "auto", pack_prompts: bool = True,
                 max_row_tokens: int = DEFAULT_MAX_ROW_TOKENS) -> None:
        self.device = resolve_device(device)
        self.model = model.to(self.device).eval()
        self.forward = ResponseForward(self.model, self.device, pack_prompts=pack_prompts,
                                       max_row_tokens=max_row_tokens)
        log.info("logprob forward: %s (%s)", self.forward.path, self.forward.why)
        # torch.distributed's DTensor loads with it: here, not where streamrl.engines is imported
        from streamrl.engines.parallel import ParallelConfigError, decoder_layers

        try:
            rebalance_at_layers(decoder_layers(self.model))  # a run's share of the host's cores (core_share.py)
        except ParallelConfigError:
            pass  # no decoder-layer classes named: the share is set at each call's start only

    @property
    def forward_path(self) -> ForwardPath:
        return self.forward.path

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Replace the model weights (strict: every name must match)."""
        self.model.load_state_dict(dict(state), strict=True)

    @torch.no_grad()
    def logprobs(
        self, prompt_ids: Sequence[Tensor], response_ids: Sequence[Tensor], temperature: float = 1.0
    ) -> list[Tensor]:
        """Per-sample logprobs [R_i] (float32, CPU) of the response tokens."""
        if len(prompt_ids) != len(response_ids):
            raise TrainBatchError(f"{len(prompt_ids)} prompts but {len(response_ids)} responses")
        if not prompt_ids:
            return []
        for i, (p, r) in enumerate(zip(prompt_ids, response_ids, strict=True)):
            check_sample(i, TrainSample(p, r, 0.0))
        logp, _ = self.forward.logprobs(prompt_ids, response_ids, temperature)
        return list(logp.cpu().split([r.numel() for r in response_ids]))
