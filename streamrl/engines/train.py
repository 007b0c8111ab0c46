"""Built-in torch train engine for one process: logprobs, streamed GRPO gradients, AdamW.

Streaming: micro-batches arrive one at a time (as the dock hands over ready samples) and the
number of tokens/sequences in the optimizer step is only known after the last one. So
``accumulate`` backpropagates an *unnormalised sum* of per-token losses and counts tokens and
sequences; ``step`` divides the summed gradients by the step's denominator (tokens for
token-mean, sequences for the seq-mean modes), clips, and steps AdamW. The gradient equals
the one of the whole batch at once, whatever the split (``tests/engines/test_train.py``).

Sequences are packed: the linear layers see only real tokens (see
``streamrl.models.functional``); the last response token is not fed (no target follows it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from streamrl.algos.grpo import LossConfig, loss_denominator, per_token_loss, unnormalized_loss
from streamrl.models.build import resolve_device, save_pretrained_dir
from streamrl.models.functional import FunctionalCausalLM, unsupported_reason


class TrainBatchError(ValueError):
    """A micro-batch sample is malformed; the message names the sample and the field."""


class NothingAccumulatedError(RuntimeError):
    """``step`` was called before any ``accumulate``."""


@dataclass(frozen=True, slots=True)
class TrainSample:
    """One completion to learn from (tensors on any device; 1-D)."""

    prompt_ids: Tensor  # [P] int64
    response_ids: Tensor  # [R] int64, EOS included when it was sampled
    advantage: float  # the sequence's (group-normalised) advantage
    rollout_logprobs: Tensor | None = None  # [R] behaviour logprobs from the generator
    old_logprobs: Tensor | None = None  # [R] recomputed by the trainer (optional)
    ref_logprobs: Tensor | None = None  # [R] reference policy (needed when kl_coef > 0)


TRAIN_COLUMNS = ("prompt_ids", "response_ids", "advantage", "rollout_logprobs", "old_logprobs", "ref_logprobs")


def samples_from_columns(columns: Mapping[str, Sequence[object]]) -> list[TrainSample]:
    """Build samples from dock columns (name -> one value per sample); absent optional columns = None."""
    for name in ("prompt_ids", "response_ids", "advantage"):
        if name not in columns:
            raise TrainBatchError(f"column {name!r} is missing; the train stage must read {list(TRAIN_COLUMNS)[:3]}")
    n = len(columns["prompt_ids"])
    for name, values in columns.items():
        if name in TRAIN_COLUMNS and len(values) != n:
            raise TrainBatchError(f"column {name!r} has {len(values)} values, prompt_ids has {n}")

    def opt(name: str, i: int) -> Tensor | None:
        values = columns.get(name)
        return None if values is None else values[i]  # type: ignore[return-value]

    return [
        TrainSample(
            prompt_ids=columns["prompt_ids"][i],  # type: ignore[arg-type]
            response_ids=columns["response_ids"][i],  # type: ignore[arg-type]
            advantage=float(columns["advantage"][i]),  # type: ignore[arg-type]
            rollout_logprobs=opt("rollout_logprobs", i),
            old_logprobs=opt("old_logprobs", i),
            ref_logprobs=opt("ref_logprobs", i),
        )
        for i in range(n)
    ]


def _check_sample(i: int, s: TrainSample) -> None:
    for name in ("prompt_ids", "response_ids"):
        t = getattr(s, name)
        if not isinstance(t, Tensor) or t.dim() != 1 or t.dtype != torch.int64:
            raise TrainBatchError(f"sample {i}: {name} must be a 1-D int64 tensor, got {_describe(t)}")
    if s.prompt_ids.numel() == 0:
        raise TrainBatchError(f"sample {i}: prompt_ids is empty")
    if not math.isfinite(s.advantage):
        raise TrainBatchError(f"sample {i}: advantage is {s.advantage}")
    n = s.response_ids.numel()
    for name in ("rollout_logprobs", "old_logprobs", "ref_logprobs"):
        t = getattr(s, name)
        if t is None:
            continue
        if not isinstance(t, Tensor) or t.dim() != 1 or not t.is_floating_point() or t.numel() != n:
            raise TrainBatchError(
                f"sample {i}: {name} must be a 1-D float tensor with one value per response token ({n}), "
                f"got {_describe(t)}"
            )


def _describe(t: object) -> str:
    if isinstance(t, Tensor):
        return f"{t.dtype} tensor of shape {tuple(t.shape)}"
    return type(t).__name__


@dataclass
class _Sums:
    """Running sums over the micro-batches of the current optimizer step."""

    loss: float = 0.0
    tokens: int = 0
    sequences: int = 0
    micro_batches: int = 0
    clipped: float = 0.0
    approx_kl: float = 0.0
    entropy: float = 0.0
    kl: float = 0.0
    kl_tokens: int = 0
    is_weight: float = 0.0
    is_tokens: int = 0
    skipped_tokens: int = 0  # zero-advantage samples: counted in the denominators, not computed
    skipped_sequences: int = 0
    mode: str | None = None


class TorchLogprobEngine:
    """Response-token logprobs of a causal LM held in this process, no gradient.

    For a frozen reference policy, or a trainer's old-policy recompute (``TorchTrainEngine``
    is one of these plus an optimizer).
    """

    def __init__(
        self, model: nn.Module, *, device: str | torch.device = "auto", use_functional: bool | None = None
    ) -> None:
        """``use_functional``: None = functional forward when the architecture allows, else HF."""
        self.device = resolve_device(device)
        self.model = model.to(self.device)
        reason = unsupported_reason(model)
        if use_functional and reason is not None:
            raise ValueError(f"use_functional=True but {reason}; pass use_functional=None")
        if getattr(model.config, "attention_dropout", 0.0):
            reason = "attention dropout"  # the functional forward has none; keep HF's training maths
        self.fn = FunctionalCausalLM(model) if (reason is None and use_functional is not False) else None

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Replace the model weights (strict: every name must match)."""
        self.model.load_state_dict(dict(state), strict=True)

    # --- forward ------------------------------------------------------------------------------
    def _response_logprobs(
        self, prompt_ids: Sequence[Tensor], response_ids: Sequence[Tensor], temperature: float, entropy: bool
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        """Logprobs [N] of every response token (flat, sample order), entropy [N] or None, seq_index [N]."""
        device = self.device
        resp_lens = torch.tensor([r.numel() for r in response_ids], device=device)
        seq_index = torch.repeat_interleave(torch.arange(len(response_ids), device=device), resp_lens)
        # Offset of each response token inside its response: 0..R_i-1.
        offset = torch.arange(seq_index.numel(), device=device) - (resp_lens.cumsum(0) - resp_lens)[seq_index]
        targets = torch.cat(list(response_ids)).to(device)
        if self.fn is not None:
            hidden_rows = self._shared_prompt_hidden(prompt_ids, response_ids, seq_index, offset)
            logits = self.fn.logits(hidden_rows)
        else:
            logits = self._hf_logits(prompt_ids, response_ids, seq_index, offset)
        logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
        logp = logp_all.gather(1, targets.unsqueeze(1)).squeeze(1)
        ent = None
        if entropy:
            with torch.no_grad():
                ent = -(logp_all.exp() * logp_all).sum(-1)
        return logp, ent, seq_index

    def _shared_prompt_hidden(
        self, prompt_ids: Sequence[Tensor], response_ids: Sequence[Tensor], seq_index: Tensor, offset: Tensor
    ) -> Tensor:
        """Pre-norm hidden state that predicts each response token, identical prompts computed once."""
        assert self.fn is not None
        device = self.device
        unique: dict[tuple[int, ...], int] = {}
        prompt_of_host = [unique.setdefault(tuple(p.tolist()), len(unique)) for p in prompt_ids]
        prompts = [torch.tensor(u, dtype=torch.int64) for u in unique]
        # Response token j is predicted by the prompt's last token (j = 0) or by response token
        # j - 1 (j >= 1); the last response token is never an input.
        conts = [r[:-1] for r in response_ids]
        p_lens = torch.tensor([p.numel() for p in prompts], device=device)
        c_lens = torch.tensor([c.numel() for c in conts], device=device)
        p_pad = torch.nn.utils.rnn.pad_sequence(prompts, batch_first=True).to(device)
        c_pad = torch.nn.utils.rnn.pad_sequence(conts, batch_first=True).to(device)
        prompt_of = torch.tensor(prompt_of_host, device=device)
        hidden, _, _ = self.fn.forward_shared_prompts(p_pad, p_lens, c_pad, c_lens, prompt_of)
        n_p = int(p_lens.sum())
        prompt_last = (p_lens.cumsum(0) - 1).index_select(0, prompt_of)[seq_index]
        cont_index = n_p + (c_lens.cumsum(0) - c_lens)[seq_index] + offset - 1
        return hidden.index_select(0, torch.where(offset == 0, prompt_last, cont_index))

    def _hf_logits(
        self, prompt_ids: Sequence[Tensor], response_ids: Sequence[Tensor], seq_index: Tensor, offset: Tensor
    ) -> Tensor:
        """Fallback: the Hugging Face forward on right-padded prompt+response rows."""
        device = self.device
        inputs = [torch.cat([p, r[:-1]]) for p, r in zip(prompt_ids, response_ids, strict=True)]
        lengths = torch.tensor([x.numel() for x in inputs], device=device)
        width = int(lengths.max())
        padded = torch.nn.utils.rnn.pad_sequence(inputs, batch_first=True).to(device)
        mask = torch.arange(width, device=device).unsqueeze(0) < lengths.unsqueeze(1)
        out = self.model(input_ids=padded, attention_mask=mask.long(), use_cache=False)
        first = torch.tensor([p.numel() - 1 for p in prompt_ids], device=device)
        rows = seq_index * width + first[seq_index] + offset
        return out.logits.reshape(-1, out.logits.shape[-1]).index_select(0, rows)

    @torch.no_grad()
    def logprobs(
        self, prompt_ids: Sequence[Tensor], response_ids: Sequence[Tensor], temperature: float = 1.0
    ) -> list[Tensor]:
        """Per-sample logprobs [R_i] (float32, CPU) of the response tokens, no gradient.

        For the old-policy recompute and for a reference model's engine.
        """
        if len(prompt_ids) != len(response_ids):
            raise TrainBatchError(f"{len(prompt_ids)} prompts but {len(response_ids)} responses")
        if not prompt_ids:
            return []
        for i, (p, r) in enumerate(zip(prompt_ids, response_ids, strict=True)):
            _check_sample(i, TrainSample(p, r, 0.0))
        was_training = self.model.training
        self.model.eval()
        try:
            logp, _, _ = self._response_logprobs(prompt_ids, response_ids, temperature, entropy=False)
        finally:
            self.model.train(was_training)
        return list(logp.cpu().split([r.numel() for r in response_ids]))



class TorchTrainEngine(TorchLogprobEngine):
    """Trains a Hugging Face causal LM held in this process (shared with a rollout engine or not)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        eps: float = 1e-8,
        max_grad_norm: float | None = 1.0,
        device: str | torch.device = "auto",
        use_functional: bool | None = None,
    ) -> None:
        """AdamW hyper-parameters as torch's; ``max_grad_norm`` None = no clipping.

        A model without trainable parameters still serves ``logprobs`` (``accumulate`` then
        says so); ``TorchLogprobEngine`` is the plain form of that.
        """
        if not lr > 0.0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if max_grad_norm is not None and not max_grad_norm > 0.0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")
        super().__init__(model, device=device, use_functional=use_functional)
        self.max_grad_norm = max_grad_norm
        self.params = [p for p in model.parameters() if p.requires_grad]
        # AdamW refuses an empty parameter list; keep a placeholder so a frozen model can still score.
        self.optimizer = torch.optim.AdamW(
            self.params or [torch.zeros(0, requires_grad=True)], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay
        )
        self.steps = 0  # optimizer steps taken = policy version of the current weights
        self._sums = _Sums()

    # --- training -----------------------------------------------------------------------------
    def accumulate(self, batch: Sequence[TrainSample], loss_config: LossConfig) -> dict[str, float]:
        """Forward + backward of one micro-batch; gradients are summed until ``step``.

        Samples with advantage exactly 0 are only counted when ``kl_coef`` is 0 (their gradient
        is exactly zero), which makes uniform-reward GRPO groups free.

        Returns this micro-batch's statistics (loss normalised within the micro-batch, for
        display only: the step normalises by the global denominator).
        """
        if not batch:
            raise TrainBatchError("empty micro-batch")
        if not self.params:
            raise ValueError(
                "the model has no trainable parameters (requires_grad is False everywhere); "
                "unfreeze it to train, or use TorchLogprobEngine to only score"
            )
        for i, s in enumerate(batch):
            _check_sample(i, s)
        if self._sums.mode not in (None, loss_config.loss_agg):
            raise ValueError(
                f"loss_agg changed within one optimizer step ({self._sums.mode!r} -> {loss_config.loss_agg!r})"
            )
        for field in ("old_logprobs", "rollout_logprobs", "ref_logprobs"):
            present = [getattr(s, field) is not None for s in batch]
            if any(present) and not all(present):
                raise TrainBatchError(f"{field} is given for some samples of the micro-batch but not all")
        sums = self._sums
        sums.mode = loss_config.loss_agg
        sums.micro_batches += 1
        all_tokens = sum(s.response_ids.numel() for s in batch)
        all_seqs = len(batch)
        local_denominator = max(loss_denominator(loss_config.loss_agg, all_tokens, all_seqs), 1)
        if loss_config.kl_coef == 0.0:
            # A zero advantage makes every per-token loss 0·(...) = 0 with zero gradient (no KL
            # term): skip their forward/backward and only count them in the denominators. GRPO
            # groups whose completions all scored the same are exactly such samples.
            active = [s for s in batch if s.advantage != 0.0]
            sums.skipped_tokens += all_tokens - sum(s.response_ids.numel() for s in active)
            sums.skipped_sequences += all_seqs - len(active)
            if not active:
                return {"loss": 0.0, "tokens": float(all_tokens), "sequences": float(all_seqs),
                        "skipped_sequences": float(all_seqs)}
            batch = active
        device = self.device
        self.model.train()
        logp, entropy, seq_index = self._response_logprobs(
            [s.prompt_ids for s in batch], [s.response_ids for s in batch], loss_config.temperature,
            entropy=loss_config.compute_entropy,
        )
        n_tokens, n_seqs = logp.numel(), len(batch)

        def column(name: str) -> Tensor | None:
            if getattr(batch[0], name) is None:
                return None
            return torch.cat([getattr(s, name) for s in batch]).to(device=device, dtype=torch.float32)

        advantages = torch.tensor([s.advantage for s in batch], dtype=torch.float32, device=device)[seq_index]
        per_token, stats = per_token_loss(
            logp, advantages, loss_config, old_logprobs=column("old_logprobs"),
            rollout_logprobs=column("rollout_logprobs"), ref_logprobs=column("ref_logprobs"),
        )
        loss_sum = unnormalized_loss(per_token, seq_index, n_seqs, loss_config.loss_agg)
        loss_sum.backward()

        sums.loss += float(loss_sum.detach())
        sums.tokens += n_tokens
        sums.sequences += n_seqs
        sums.clipped += float(stats["clipped"].sum())
        sums.approx_kl += float(stats["approx_kl"].sum())
        if entropy is not None:
            sums.entropy += float(entropy.sum())
        if "kl" in stats:
            sums.kl += float(stats["kl"].sum())
            sums.kl_tokens += n_tokens
        if "is_weight" in stats:
            sums.is_weight += float(stats["is_weight"].sum())
            sums.is_tokens += n_tokens
        out = {
            "loss": float(loss_sum.detach()) / local_denominator,
            "tokens": float(all_tokens),
            "sequences": float(all_seqs),
            "skipped_sequences": float(all_seqs - n_seqs),
            "clip_fraction": float(stats["clipped"].mean()) if n_tokens else 0.0,
        }
        if entropy is not None and n_tokens:
            out["entropy"] = float(entropy.mean())
        return out

    def pending(self) -> dict[str, int]:
        """Tokens, sequences and micro-batches accumulated since the last step (skipped ones included)."""
        s = self._sums
        return {"tokens": s.tokens + s.skipped_tokens, "sequences": s.sequences + s.skipped_sequences,
                "micro_batches": s.micro_batches}

    def step(self, *, global_tokens: int | None = None, global_sequences: int | None = None) -> dict[str, float]:
        """Normalise the summed gradients, clip, AdamW step, zero gradients.

        ``global_tokens`` / ``global_sequences`` override the local counts when several
        data-parallel ranks contribute to one step (all-reduce the counts of ``pending()``).
        """
        sums = self._sums
        if sums.micro_batches == 0 or sums.mode is None:
            raise NothingAccumulatedError("step() called before any accumulate() since the last step")
        tokens = sums.tokens + sums.skipped_tokens if global_tokens is None else global_tokens
        sequences = sums.sequences + sums.skipped_sequences if global_sequences is None else global_sequences
        denominator = loss_denominator(sums.mode, tokens, sequences)  # type: ignore[arg-type]
        grads = [p.grad for p in self.params if p.grad is not None]
        if denominator > 0 and grads:
            torch._foreach_div_(grads, float(denominator))
        if self.max_grad_norm is not None:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        else:
            grad_norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        stats = {
            "step": float(self.steps),
            "loss": sums.loss / max(denominator, 1),
            "grad_norm": float(grad_norm),
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            "tokens": float(sums.tokens + sums.skipped_tokens),
            "sequences": float(sums.sequences + sums.skipped_sequences),
            "skipped_sequences": float(sums.skipped_sequences),  # zero advantage, no forward/backward
            "micro_batches": float(sums.micro_batches),
            # Averages over the computed tokens (skipped samples have no logprobs here).
            "clip_fraction": sums.clipped / max(sums.tokens, 1),
            "approx_kl": sums.approx_kl / max(sums.tokens, 1),
            "entropy": sums.entropy / max(sums.tokens, 1),
        }
        if sums.kl_tokens:
            stats["kl"] = sums.kl / sums.kl_tokens
        if sums.is_tokens:
            stats["is_weight"] = sums.is_weight / sums.is_tokens
        self._sums = _Sums()
        return stats

    def zero_grad(self) -> None:
        """Drop accumulated gradients and counts without stepping."""
        self.optimizer.zero_grad(set_to_none=True)
        self._sums = _Sums()

    # --- weights ------------------------------------------------------------------------------
    def state_dict(self, *, copy: bool = True) -> dict[str, Tensor]:
        """Model weights to publish to generators (detached; copies unless ``copy=False``)."""
        return {k: (v.detach().clone() if copy else v.detach()) for k, v in self.model.state_dict().items()}

    def save_checkpoint(self, path: str | Path, tokenizer: PreTrainedTokenizerBase | None = None) -> Path:
        """Write a ``from_pretrained``-loadable directory (safetensors + config + tokenizer)."""
        return save_pretrained_dir(self.model, tokenizer, path)

    def set_lr(self, lr: float) -> None:
        """Change the learning rate of every parameter group (schedules live outside)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
