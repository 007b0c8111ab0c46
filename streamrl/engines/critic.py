"""The critic's train engine: a value model (:class:`~streamrl.models.value.CausalLMValueModel`) on
torch FSDP2 with its own AdamW, trained on PPO's clipped value loss.

It is :class:`~streamrl.engines.fsdp.FSDPTrainEngine` with another forward and loss: the sharding,
the exact streamed normalisation (``accumulate_values`` backpropagates the unnormalised sum of
per-token losses, ``step`` divides by the step's token count over the dp ranks: token-mean),
gradient clipping, the optimizer step, ``full_state_dict`` and the DCP checkpoints of
:mod:`streamrl.engines.checkpoint` are the policy engine's own. Collectives as there: every rank
makes the same calls in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import torch
from torch import Tensor

from streamrl.algos.losses import clipped_value_loss
from streamrl.engines.fsdp import FSDPOptions, FSDPTrainEngine
from streamrl.engines.packing import padded_inputs
from streamrl.engines.samples import TrainBatchError, TrainSample, check_sample
from streamrl.models.value import CausalLMValueModel


class FSDPCriticEngine(FSDPTrainEngine):
    """Trains a value model sharded with FSDP2; ``values`` computes the values the advantages use."""

    def __init__(self, model: CausalLMValueModel, *, options: FSDPOptions = FSDPOptions(), **kwargs: Any) -> None:
        # the policy engine's shared-prompt packing probe reads logits: the value model has none
        super().__init__(model, options=msgspec.structs.replace(options, pack_prompts=False), **kwargs)

    def _flat_values(self, prompt_ids: Sequence[Tensor], response_ids: Sequence[Tensor]) -> Tensor:
        """[N] float32: the value at the position predicting each response token (flat, sample order)."""
        inputs = padded_inputs(prompt_ids, response_ids, self.device, keep_from_first=False)
        return self.model(**inputs.kwargs).reshape(-1).index_select(0, inputs.rows)

    def _check(self, prompt_ids: Sequence[Tensor], response_ids: Sequence[Tensor],
               **per_token: Sequence[Tensor] | None) -> None:
        if len(prompt_ids) != len(response_ids):
            raise TrainBatchError(f"{len(prompt_ids)} prompts but {len(response_ids)} responses")
        for i, (p, r) in enumerate(zip(prompt_ids, response_ids, strict=True)):
            check_sample(i, TrainSample(p, r, 0.0))
            for name, column in per_token.items():
                if column is None:
                    continue
                t = column[i]
                if not isinstance(t, Tensor) or t.dim() != 1 or t.numel() != r.numel():
                    raise TrainBatchError(f"sample {i}: {name} must be a 1-D tensor with one value per response "
                                          f"token ({r.numel()})")

    @torch.no_grad()
    def values(self, prompt_ids: Sequence[Tensor], response_ids: Sequence[Tensor]) -> list[Tensor]:
        """Per-sample values [R_i] (float32, CPU) of the response tokens' states, no gradient (collective)."""
        self.check_on_device()
        self._check(prompt_ids, response_ids)
        was_training = self.model.training
        self.model.eval()
        try:
            if not prompt_ids:  # the other ranks' all-gathers still need this rank's forward
                self.model(input_ids=torch.zeros((1, 1), dtype=torch.int64, device=self.device))
                return []
            flat = self._flat_values(prompt_ids, response_ids)
        finally:
            self.model.train(was_training)
            self._reshard()
        return list(flat.cpu().split([r.numel() for r in response_ids]))

    def accumulate_values(self, prompt_ids: Sequence[Tensor], response_ids: Sequence[Tensor],
                          old_values: Sequence[Tensor], returns: Sequence[Tensor], value_clip: float | None,
                          loss_mask: Sequence[Tensor] | None = None) -> dict[str, float]:
        """Forward + backward of the clipped value loss's sum over this micro-batch's trained tokens
        (``loss_mask`` 1, or all); gradients add up until ``step`` divides by the step's tokens (collective)."""
        self.check_on_device()
        if not prompt_ids:
            raise TrainBatchError("empty micro-batch; a rank with nothing left calls accumulate_padding()")
        self._check(prompt_ids, response_ids, old_values=old_values, returns=returns, loss_mask=loss_mask)
        self.model.train()
        values = self._flat_values(prompt_ids, response_ids)
        old = torch.cat([v.reshape(-1) for v in old_values]).to(self.device, torch.float32)
        target = torch.cat([v.reshape(-1) for v in returns]).to(self.device, torch.float32)
        if loss_mask is not None:
            keep = torch.cat([m.reshape(-1) for m in loss_mask]).to(self.device, torch.bool)
            values, old, target = values[keep], old[keep], target[keep]
        loss, clipped = clipped_value_loss(values, old, target, value_clip)
        loss_sum = loss.sum()
        loss_sum.backward()
        sums = self._sums
        sums.mode, sums.norm_tokens = "token-mean", 1  # what step() divides by: the step's trained tokens
        sums.micro_batches += 1
        sums.loss += float(loss_sum.detach())
        sums.tokens += int(loss.numel())
        sums.sequences += len(prompt_ids)
        sums.clipped += float(clipped.sum())
        return {"loss": float(loss_sum.detach()) / max(loss.numel(), 1), "tokens": float(loss.numel())}

    def _zero_backward(self) -> None:
        # as the policy engine's, through the value model's forward (it returns values, not logits)
        self.model.train()
        ids = torch.zeros((1, 1), dtype=torch.int64, device=self.device)
        (self.model(input_ids=ids).sum() * 0.0).backward()
