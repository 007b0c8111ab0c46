"""Attention over shared-prompt rows (:mod:`streamrl.engines.packing`) without the dense mask.

A packed row is ``[prompt | c1 | c2 | ... | cG]``: every completion attends to the prompt and to
itself, nothing else. Through the model's SDPA with a 4-D mask, each row's attention costs
``width^2`` — (P + G*C)^2 scores, of which about G-fold too many are masked out, and the
masked ones cost as much as the rest (SDPA has no block skipping on a dense mask). This module
computes the same attention in two dense pieces:

- each prompt occurrence, causally: ``[prompts, heads, P, P]``;
- each completion against ``[its prompt's keys | its own keys]``: ``[completions, heads,
  C, P + C]``, the prompt keys and values gathered once per completion.

That is (P + C) * C scores per completion instead of (P + G*C)^2 / G, about G-fold less work
for long completions (a GRPO group of 8 × 500 tokens: 8×), at the price of a few gathers per
layer. Since nothing here depends on which row a token is in, the packing fills its rows with
several groups each (every group a prompt occurrence of its own) where it uses a layout, so the
linear layers skip the padding that one group per row would need. The train step is 1.0-2.1×
faster from ~100-token rows on, and 1.1-1.3× at narrower rows that one group per row would pad by
a fifth or more; it is slower on narrow rows with little padding, W1's (docs/benchmarks.md §18,
§42), so
the engines use it from a width or an amount of padding on (``shared_prefix_min_width``,
``shared_prefix_min_padding``).

It plugs in through transformers' attention interface: :func:`enable` switches a model whose
attention is ``sdpa`` to the implementation registered here, which computes exactly what
``sdpa`` would (same mask function, same kernel) unless the call carries a
``shared_prefix`` layout (:class:`SharedPrefixLayout`, passed through the model's forward as a
keyword argument, which transformers hands to every attention call). Whether a model computes
the same logprobs this way is checked by :func:`streamrl.engines.packing.probe_packing`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from streamrl.models.matmul_precision import ieee_attention

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
    """Where each prompt occurrence and each completion of packed rows sit, as flat indices into the
    ``rows * width`` token positions of the forward, and the masks of the two attention pieces.

    A row may hold several prompt occurrences, each followed by its completions (the packing fills
    rows instead of padding each group's row to the widest): a completion attends to its own
    occurrence only, so what shares a row does not matter to the attention."""

    prompt_index: Tensor  # [prompts, Pmax] flat position of each occurrence's token (padding: its first)
    prompt_valid: Tensor  # [prompts, Pmax] bool: a real prompt token
    prompt_mask: Tensor  # [prompts, 1, Pmax, Pmax] bool: causal over the occurrence's tokens
    completion_index: Tensor  # [n, Cmax] flat position of each completion's input tokens (padding: its first)
    completion_valid: Tensor  # [n, Cmax] bool: a real input token
    completion_prompt: Tensor  # [n] prompt occurrence of each completion
    completion_mask: Tensor  # [n, 1, Cmax, Pmax + Cmax] bool: its prompt occurrence, then itself causally
    # [rows * width]: each token position's output in [prompts*Pmax prompt outputs | n*Cmax completion
    # outputs | a zero row]; every real token reads its own, padding positions the zero row
    output_index: Tensor
    tokens: int  # rows * width: the forward's token positions
    # G when completion_prompt is 0,..,0, 1,..,1, ... (every occurrence's G completions in order, GRPO's
    # packing): each completion's prompt keys are then a broadcast, whose backward is a sum over G
    # instead of an index_add (a scatter: ~2 % of a W2 train step); None otherwise
    completions_per_prompt: int | None = None
    # the masks as additive biases, made by the first layer's attention for the others (masked_attention)
    biases: dict[tuple[object, ...], Tensor] = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def build(prompts: Sequence[tuple[int, int, int]], completions: Sequence[tuple[int, int, int]], width: int,
              device: torch.device) -> SharedPrefixLayout:
        """``prompts``: (row, first position, tokens >= 1) of every prompt occurrence; ``completions``:
        (prompt occurrence, first position in its row, input tokens >= 1) of every completion."""
        rows = max(r for r, _, _ in prompts) + 1
        p_max = max(n for _, _, n in prompts)
        c_max = max((n for _, _, n in completions), default=1)
        plen = torch.tensor([n for _, _, n in prompts], dtype=torch.int64)
        cols = torch.arange(p_max)
        prompt_valid = cols.unsqueeze(0) < plen.unsqueeze(1)
        prompt_start = torch.tensor([r * width + first for r, first, _ in prompts], dtype=torch.int64).unsqueeze(1)
        prompt_index = torch.where(prompt_valid, prompt_start + cols, prompt_start)
        causal_p = torch.ones(p_max, p_max, dtype=torch.bool).tril()
        # key j < P of the occurrence; a padding query (i >= P) still sees key 0, so its softmax is finite
        prompt_mask = (causal_p & prompt_valid.unsqueeze(1)).unsqueeze(1)

        cprompt = torch.tensor([o for o, _, _ in completions], dtype=torch.int64)
        crow = torch.tensor([prompts[o][0] for o, _, _ in completions], dtype=torch.int64)
        cstart = torch.tensor([s for _, s, _ in completions], dtype=torch.int64)
        clen = torch.tensor([n for _, _, n in completions], dtype=torch.int64)
        ccols = torch.arange(c_max)
        completion_valid = ccols.unsqueeze(0) < clen.unsqueeze(1)
        first = crow * width + cstart
        completion_index = torch.where(completion_valid, first.unsqueeze(1) + ccols, first.unsqueeze(1))
        sees_prompt = prompt_valid.index_select(0, cprompt).unsqueeze(1).expand(-1, c_max, -1)  # [n, Cmax, Pmax]
        sees_self = torch.ones(c_max, c_max, dtype=torch.bool).tril() & completion_valid.unsqueeze(1)
        completion_mask = torch.cat([sees_prompt, sees_self], dim=2).unsqueeze(1)
        source = torch.cat([prompt_valid.reshape(-1).nonzero().squeeze(1),
                            len(prompts) * p_max + completion_valid.reshape(-1).nonzero().squeeze(1)])
        destination = torch.cat([prompt_index[prompt_valid], completion_index[completion_valid]])
        outputs = len(prompts) * p_max + len(completions) * c_max
        output_index = torch.full((rows * width,), outputs, dtype=torch.int64)  # padding: the zero row
        output_index[destination] = source
        per_prompt = len(completions) // len(prompts)
        in_order = len(completions) > 0 and torch.equal(
            cprompt, torch.arange(len(prompts)).repeat_interleave(per_prompt)
        )
        return SharedPrefixLayout(
            prompt_index.to(device), prompt_valid.to(device), prompt_mask.to(device),
            completion_index.to(device), completion_valid.to(device), cprompt.to(device), completion_mask.to(device),
            output_index.to(device), rows * width, per_prompt if in_order else None,
        )


# Scores a call materialises at most (queries x keys x heads x rows) in masked_attention: 2 Mi float32
# scores, 8 MiB. Below it, scores written out by one batched matmul and read back by the softmax and
# the second matmul took 0.27-0.68x the time of SDPA's flash kernel on a CPU at 2 threads and
# 0.78-1.12x at 1, forward and backward together (W2's completions: 4.5 against 6.6 ms a layer at
# 2 threads); at 3 Mi scores 0.86x / 1.10x, from 12 Mi on the flash kernel was 1.6-2.1x faster, and
# its memory does not grow with keys x queries (ops/bench/prefix_attention.py --kernels,
# docs/benchmarks.md §44).
MATERIALIZED_MAX_SCORES = 2 * 2**20


def masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, dropout: float, scale: float | None,
                     biases: dict[tuple[object, ...], Tensor], name: str) -> Tensor:
    """SDPA of q [n, h, Lq, d] over k, v [n, h_kv, Lk, d] (h a multiple of h_kv) under a boolean mask
    [n, 1, Lq, Lk] shared by the heads, in which every query sees a key -> [n, h, Lq, d].

    A small call on a CPU materialises its scores (:data:`MATERIALIZED_MAX_SCORES`): one batched matmul
    with the mask added in it, a softmax, a second batched matmul. Each kv head's query heads are
    stacked as one matrix of rows, so grouped-query attention reads its keys once. The additive mask,
    the same in every layer, is made once into ``biases`` under ``name``."""
    n, heads, lq, d = q.shape
    kv_heads, lk = k.shape[1], k.shape[2]
    if dropout > 0 or q.device.type != "cpu" or n * heads * lq * lk > MATERIALIZED_MAX_SCORES:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale,
                                              enable_gqa=kv_heads != heads)
    rep = heads // kv_heads
    key = (name, q.dtype, kv_heads, rep)
    bias = biases.get(key)
    if bias is None:
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
        bias = biases[key] = bias.unsqueeze(1).expand(n, kv_heads, rep, lq, lk).reshape(n * kv_heads, rep * lq, lk)
    scores = torch.baddbmm(bias, q.reshape(n * kv_heads, rep * lq, d), k.reshape(n * kv_heads, lk, d).transpose(1, 2),
                           alpha=d**-0.5 if scale is None else scale)
    out = torch.bmm(torch.softmax(scores, dim=-1), v.reshape(n * kv_heads, lk, d))
    return out.view(n, heads, lq, d)


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

    Without a layout this is ``sdpa`` exactly. With one, the mask is not read (the packing passes a
    placeholder); a sliding window, whose band the layout does not encode, is refused. Its matmuls
    run at full float32 precision whatever the run's ``model.matmul_precision``
    (:func:`streamrl.models.matmul_precision.ieee_attention`)."""
    return ieee_attention(lambda q, k, v: _attention(module, q, k, v, attention_mask, dropout, scaling, shared_prefix,
                                                     **kwargs), query, key, value)


def _attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
               dropout: float, scaling: float | None, shared_prefix: SharedPrefixLayout | None,
               **kwargs: object) -> tuple[Tensor, None]:
    if shared_prefix is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if kwargs.get("sliding_window") is not None:
        raise ValueError("the shared-prefix layout does not encode a sliding window: this model needs the dense "
                         "mask (FSDPOptions.shared_prefix_attention false)")
    global layout_calls
    layout_calls += 1
    layout = shared_prefix
    batch, heads, length, d = query.shape
    kv_heads = key.shape[1]
    if batch * length != layout.tokens:
        raise ValueError(f"shared-prefix layout covers {layout.tokens} token positions, the attention call "
                         f"{batch} x {length}; build the layout with the same packed rows")
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
    out_prompt = masked_attention(gather(q, layout.prompt_index), kp, vp, layout.prompt_mask, p, scaling,
                                  layout.biases, "prompt")

    def per_completion(t: Tensor) -> Tensor:  # [prompts, h, P, d] -> [n, h, P, d]: each completion's prompt
        g = layout.completions_per_prompt
        if g is None:
            return t.index_select(0, layout.completion_prompt)
        return t.unsqueeze(1).expand(t.shape[0], g, *t.shape[1:]).flatten(0, 1)

    ck = torch.cat([per_completion(kp), gather(k, layout.completion_index)], dim=2)
    cv = torch.cat([per_completion(vp), gather(v, layout.completion_index)], dim=2)
    out_completion = masked_attention(gather(q, layout.completion_index), ck, cv, layout.completion_mask, p,
                                      scaling, layout.biases, "completion")
    # Every real token reads its one output; padding positions read the zero row (their logits are
    # never read). One index_select: its backward is one index_add.
    pieces = torch.cat([out_prompt.transpose(1, 2).reshape(-1, heads, d),
                        out_completion.transpose(1, 2).reshape(-1, heads, d), q.new_zeros(1, heads, d)])
    return pieces.index_select(0, layout.output_index).view(batch, length, heads, d), None


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
