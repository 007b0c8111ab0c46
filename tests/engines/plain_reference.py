"""The oracle the FSDP2 engine is checked against, written independently of it.

The plain Hugging Face module in this process: no FSDP, no packing (one forward per sample), the
loss maths of :mod:`streamrl.algos.grpo`, torch's own ``clip_grad_norm_`` and ``AdamW``. A step
is the mean over the whole step's tokens (or sequences), as one process computing everything.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from streamrl.algos.grpo import LossConfig, loss_denominator, per_token_loss, unnormalized_loss
from streamrl.engines.samples import TrainSample


class PlainReference:
    def __init__(self, model: nn.Module, *, lr: float, max_grad_norm: float | None = 1.0) -> None:
        self.model = model.float().train()
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, foreach=False)
        self.max_grad_norm = max_grad_norm
        self._reset()

    def _reset(self) -> None:
        self.tokens = self.sequences = 0
        self.loss = 0.0
        self.mode: str | None = None

    def _logp(self, prompt: Tensor, response: Tensor, temperature: float) -> Tensor:
        if response.numel() == 0:
            return torch.zeros(0)
        ids = torch.cat([prompt, response[:-1]]).unsqueeze(0)
        logits = self.model(input_ids=ids, use_cache=False).logits[0, prompt.numel() - 1:]
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        return logp.gather(1, response.unsqueeze(1)).squeeze(1)

    @torch.no_grad()
    def logprobs(self, prompt_ids: Sequence[Tensor], response_ids: Sequence[Tensor],
                 temperature: float = 1.0) -> list[Tensor]:
        return [self._logp(p, r, temperature) for p, r in zip(prompt_ids, response_ids, strict=True)]

    def accumulate(self, batch: Sequence[TrainSample], config: LossConfig) -> None:
        logp = torch.cat([self._logp(s.prompt_ids, s.response_ids, config.temperature) for s in batch])
        lens = torch.tensor([s.response_ids.numel() for s in batch])
        seq_index = torch.repeat_interleave(torch.arange(len(batch)), lens)
        advantages = torch.tensor([s.advantage for s in batch])[seq_index]

        def column(name: str) -> Tensor | None:
            values = [getattr(s, name) for s in batch]
            return None if values[0] is None else torch.cat(values).float()

        per_token, _ = per_token_loss(logp, advantages, config, seq_index=seq_index,
                                      old_logprobs=column("old_logprobs"),
                                      rollout_logprobs=column("rollout_logprobs"),
                                      ref_logprobs=column("ref_logprobs"))
        loss = unnormalized_loss(per_token, seq_index, len(batch), config.loss_agg)
        loss.backward()
        self.loss += float(loss.detach())
        self.tokens += int(lens.sum())
        self.sequences += len(batch)
        self.mode = config.loss_agg
        self.norm_tokens = config.norm_tokens or 1

    def step(self) -> dict[str, float]:
        assert self.mode is not None
        denominator = max(loss_denominator(self.mode, self.tokens, self.sequences, self.norm_tokens), 1)  # type: ignore[arg-type]
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad /= denominator
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm or float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        stats = {"loss": self.loss / denominator, "grad_norm": float(norm)}
        self._reset()
        return stats

    def state_dict(self) -> dict[str, Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}
