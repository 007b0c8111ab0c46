"""A value model (PPO's critic): any ``transformers`` causal LM's backbone with a linear value head.

The critic starts from the policy's own weights (the same tiny config and seed, or the same
``model.path`` checkpoint): its backbone is the LM's ``base_model`` (the decoder stack without
the LM head, which a critic does not need) and a ``Linear(hidden, 1)`` maps each position's last
hidden state to one scalar, initialised small so the first values are about 0 and the first
updates move the head before they disturb the backbone.

``forward(input_ids, attention_mask)`` returns the value at every position [B, L] (float32);
the value of response token t is the one at the position that predicts it, the state before the
token was sampled (:func:`streamrl.engines.packing.padded_inputs` gives those positions).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

HEAD_INIT_STD = 1e-3  # small: the first values are about 0 whatever the backbone's hidden states


class CausalLMValueModel(nn.Module):
    """``lm``'s backbone + a value head. Exposes what the FSDP2 engine reads of a HF model:
    ``config`` and ``_no_split_modules`` (its decoder-layer classes, sharded one by one)."""

    def __init__(self, lm: PreTrainedModel, *, seed: int = 0, head_init_std: float = HEAD_INIT_STD) -> None:
        """``seed``: the head's initialisation (its own generator: every rank and rerun draws the same)."""
        super().__init__()
        self.backbone = lm.base_model  # e.g. Qwen2Model for Qwen2ForCausalLM: no LM head
        if self.backbone is lm:
            raise ValueError(f"{type(lm).__name__} has no base model under base_model_prefix "
                             f"{getattr(lm, 'base_model_prefix', '')!r}; a value head needs the LM's backbone")
        self.config = lm.config
        self._no_split_modules = list(getattr(lm, "_no_split_modules", None) or [])
        hidden = int(self.config.get_text_config().hidden_size)
        self.value_head = nn.Linear(hidden, 1)
        with torch.no_grad():
            self.value_head.weight.normal_(0.0, head_init_std, generator=torch.Generator().manual_seed(seed))
            self.value_head.bias.zero_()
        self.value_head.to(device=next(lm.parameters()).device, dtype=next(lm.parameters()).dtype)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, **kwargs: Any) -> Tensor:
        """Values [B, L], float32, one per position."""
        kwargs.pop("use_cache", None)
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                               **kwargs).last_hidden_state
        # sum over the head's one output, not squeeze: FSDP2 warns of (and mishandles in-place ops on)
        # a view returned by a wrapped module
        return self.value_head(hidden.to(self.value_head.weight.dtype)).sum(-1).float()
