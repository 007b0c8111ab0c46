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

from streamrl.engines.packing import (
    DEFAULT_MAX_ROW_TOKENS,
    ForwardPath,
    attention_mask_dtype,
    model_inputs,
    probe_packing,
    response_logits,
    uses_logits_to_keep,
)
from streamrl.engines.samples import TrainBatchError, TrainSample, check_sample
from streamrl.models.build import resolve_device

log = logging.getLogger("streamrl.engine.logprob")


class LogprobEngine:
    """Scores responses under a model held in this process, no gradient."""

    def __init__(self, model: nn.Module, *, device: str | torch.device = "auto", pack_prompts: bool = True,
                 max_row_tokens: int = DEFAULT_MAX_ROW_TOKENS) -> None:
        self.device = resolve_device(device)
        self.model = model.to(self.device).eval()
        self.max_row_tokens = max_row_tokens
        self.forward_path: ForwardPath = "padded"
        why = "pack_prompts is off"
        if pack_prompts:
            vocab = int(model.get_input_embeddings().weight.shape[0])
            self.forward_path, why = probe_packing(self.model, vocab, self.device)
        log.info("logprob forward: %s (%s)", self.forward_path, why)
        self._mask_dtype = attention_mask_dtype(model)
        self._logits_to_keep = uses_logits_to_keep(model)

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
        inputs = model_inputs(self.forward_path, prompt_ids, response_ids, self.device, mask_dtype=self._mask_dtype,
                              max_row_tokens=self.max_row_tokens, keep_from_first=self._logits_to_keep)
        logits = response_logits(self.model, inputs)
        targets = torch.cat([r.reshape(-1) for r in response_ids]).to(self.device)
        logp = torch.log_softmax(logits.float() / temperature, dim=-1).gather(1, targets.unsqueeze(1)).squeeze(1)
        return list(logp.cpu().split([r.numel() for r in response_ids]))
