"""Attention over shared-prompt rows (:mod:`streamrl.engines.packing`) without the dense mask.

A packed row is ``[prompt | c1 | c2 | ... | cG]``: every completion attends to the prompt and to
itself, nothing else. Through the model's SDPA with a 4-D mask, each row's attention costs
``width^2`` — (P + G*C)^2 scores, of which about G-fold too many are masked out, and the
masked ones cost as much as the rest (SDPA has no block skipping on a dense mask). This module
computes the same attention in two dense pieces:

- each row's prompt, causally: ``[rows, heads, P, P]``;
- each completion against ``[its row's prompt keys | its own keys]``: ``[completions, heads,
  C, P + C]``, the prompt keys and values gathered once per completion.

That is (P + C) * C scores per completion instead of (P + G*C)^2 / G, about G-fold less work
for long completions (a GRPO group of 8 × 500 tokens: 8×), at the price of a few gathers per
layer: the train step is 1.2-2× faster from 512-token rows on and slower below
(docs/benchmarks.md §18), so the engines use it from a row width on (``shared_prefix_min_width``).

It plugs in through transformers' attention interface: :func:`enable` switches a model whose
attention is ``sdpa`` to the implementation registered here, which computes exactly what
``sdpa`` would (same mask function, same kernel) unless the call carries a
``shared_prefix`` layout (:class:`SharedPrefixLayout`, passed through the model's forward as a
keyword argument, which transformers hands to every attention call). Whether a model computes
the same logprobs this way is checked by :func:`streamrl.engines.packing.probe_packing`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

try:  # transformers' pluggable attention (4.53+); older versions keep the dense mask
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as exc:  # pragma: no cover - depends on the installed transformers
    UNAVAILABLE: str | None = f"this transformers has no pluggable attention ({exc})"
else:
    UNAVAILABLE = None

IMPLEMENTATION = "streamrl_shared_prefix"  # the name registered with transformers' attention interfaces
layout_calls = 0  # attention calls that used a layout: lets a probe see the model really passed it through


@dataclass(frozen=True)
class SharedPrefixLayout:
    """Where the prompt and each completion of packed rows sit, as flat indices into the
    ``rows * width`` token positions of the forward, and the masks of the two attention pieces."""

    prompt_index: Tensor  # [rows, Pmax] flat position of each row's prompt token (padding: the row's first)
    prompt_valid: Tensor  # [rows, Pmax] bool: a real prompt token
    prompt_mask: Tensor  # [rows, 1, Pmax, Pmax] bool: causal over the row's prompt
    completion_index: Tensor  # [n, Cmax] flat position of each completion's input tokens (padding: its first)
    completion_valid: Tensor  # [n, Cmax] bool: a real input token
    completion_row: Tensor  # [n] row of each completion
    completion_mask: Tensor  # [n, 1, Cmax, Pmax + Cmax] bool: the row's prompt, then itself causally
    # every real token once: its position in [rows*Pmax prompt outputs | n*Cmax completion outputs],
    # and its flat position in the forward
    source: Tensor
    destination: Tensor
    tokens: int  # rows * width: the forward's token positions

    @staticmethod
    def build(prompt_lengths: Sequence[int], completions: Sequence[tuple[int, int, int]], width: int,
              device: torch.device) -> SharedPrefixLayout:
        """``prompt_lengths[r]``: row r's prompt tokens (at positions 0..P-1); ``completions``:
        (row, first position, input tokens >= 1) of every completion."""
        rows = len(prompt_lengths)
        p_max = max(prompt_lengths)
        c_max = max((n for _, _, n in completions), default=1)
        plen = torch.tensor(prompt_lengths, dtype=torch.int64)
        cols = torch.arange(p_max)
        prompt_valid = cols.unsqueeze(0) < plen.unsqueeze(1)
        row_start = torch.arange(rows).unsqueeze(1) * width
        prompt_index = torch.where(prompt_valid, row_start + cols, row_start)
        causal_p = torch.ones(p_max, p_max, dtype=torch.bool).tril()
        # key j < P of the row; a padding query (i >= P) still sees key 0, so its softmax is finite
        prompt_mask = (causal_p & prompt_valid.unsqueeze(1)).unsqueeze(1)

        crow = torch.tensor([r for r, _, _ in completions], dtype=torch.int64)
        cstart = torch.tensor([s for _, s, _ in completions], dtype=torch.int64)
        clen = torch.tensor([n for _, _, n in completions], dtype=torch.int64)
        ccols = torch.arange(c_max)
        completion_valid = ccols.unsqueeze(0) < clen.unsqueeze(1)
        first = crow * width + cstart
        completion_index = torch.where(completion_valid, first.unsqueeze(1) + ccols, first.unsqueeze(1))
        sees_prompt = prompt_valid.index_select(0, crow).unsqueeze(1).expand(-1, c_max, -1)  # [n, Cmax, Pmax]
        sees_self = torch.ones(c_max, c_max, dtype=torch.bool).tril() & completion_valid.unsqueeze(1)
        completion_mask = torch.cat([sees_prompt, sees_self], dim=2).unsqueeze(1)
        source = torch.cat([prompt_valid.reshape(-1).nonzero().squeeze(1),
                            rows * p_max + completion_valid.reshape(-1).nonzero().squeeze(1)])
        destination = torch.cat([prompt_index[prompt_valid], completion_index[completion_valid]])
        return SharedPrefixLayout(
            prompt_index.to(device), prompt_valid.to(device), prompt_mask.to(device),
            completion_index.to(device), completion_valid.to(device), crow.to(device), completion_mask.to(device),
            source.to(device), destination.to(device), rows * width,
        )


def shared_prefix_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    shared_prefix: SharedPrefixLayout | None = None,
    **kwargs: object,
) -> tuple[Tensor, None]:
    """transformers' attention signature: q [B, H, L, d], k/v [B, Hkv, L, d] -> out [B, L, H, d].

    Without a layout (or with a sliding window, whose band the layout does not encode) this is
    ``sdpa`` exactly."""
    if shared_prefix is None or kwargs.get("sliding_window") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    global layout_calls
    layout_calls += 1
    layout = shared_prefix
    batch, heads, length, d = query.shape
    kv_heads = key.shape[1]
    if batch * length != layout.tokens:
        raise ValueError(f"shared-prefix layout covers {layout.tokens} token positions, the attention call "
                         f"{batch} x {length}; build the layout with the same packed rows")
    gqa = kv_heads != heads
    # token-major views [B*L, heads, d]: gathering whole token rows keeps each index one lookup
    q = query.transpose(1, 2).reshape(batch * length, heads, d)
    k = key.transpose(1, 2).reshape(batch * length, kv_heads, d)
    v = value.transpose(1, 2).reshape(batch * length, kv_heads, d)
    p = dropout if module.training else 0.0

    def gather(t: Tensor, index: Tensor) -> Tensor:  # [T, h, d] -> [n, h, len, d]
        # index_select, not t[index]: its backward is an index_add, where advanced indexing's is a
        # sorting accumulate (several times slower on CPU)
        return t.index_select(0, index.reshape(-1)).view(*index.shape, *t.shape[1:]).transpose(1, 2)

    kp, vp = gather(k, layout.prompt_index), gather(v, layout.prompt_index)
    out_prompt = F.scaled_dot_product_attention(gather(q, layout.prompt_index), kp, vp,
                                                attn_mask=layout.prompt_mask, dropout_p=p, scale=scaling,
                                                enable_gqa=gqa)
    ck = torch.cat([kp.index_select(0, layout.completion_row), gather(k, layout.completion_index)], dim=2)
    cv = torch.cat([vp.index_select(0, layout.completion_row), gather(v, layout.completion_index)], dim=2)
    out_completion = F.scaled_dot_product_attention(gather(q, layout.completion_index), ck, cv,
                                                    attn_mask=layout.completion_mask, dropout_p=p, scale=scaling,
                                                    enable_gqa=gqa)
    # Every real token is written once; padding positions stay 0 (their logits are never read).
    pieces = torch.cat([out_prompt.transpose(1, 2).reshape(-1, heads, d),
                        out_completion.transpose(1, 2).reshape(-1, heads, d)])
    out = q.new_zeros(batch * length, heads, d).index_copy(0, layout.destination,
                                                           pieces.index_select(0, layout.source))
    return out.view(batch, length, heads, d), None


if UNAVAILABLE is None:
    AttentionInterface.register(IMPLEMENTATION, shared_prefix_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)  # without a layout: sdpa's masks, built as for sdpa


def enable(model: nn.Module) -> bool:
    """Switch ``model``'s attention from ``sdpa`` to the shared-prefix one (which is ``sdpa`` for
    every call without a layout). False, and nothing changed, for any other attention."""
    config = getattr(model, "config", None)
    if UNAVAILABLE is not None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    config._attn_implementation = IMPLEMENTATION  # type: ignore[union-attr]
    return True


def disable(model: nn.Module) -> None:
    """Undo :func:`enable`."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == IMPLEMENTATION:
        config._attn_implementation = "sdpa"  # type: ignore[union-attr]
