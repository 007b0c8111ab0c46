"""A tensor-parallel forward over the fused inference layout (vLLM style), for checking a reshard.

Given one inference rank's weights (``qkv_proj``, ``gate_up_proj``, row-parallel ``o_proj`` and
``down_proj``, vocab-parallel ``embed_tokens``/``lm_head``), the T ranks of an inference group
together compute the full model's logits: all-reduce after each row-parallel projection and
after the vocab-parallel embedding lookup, all-gather of the vocab-parallel logits. It is the
reference that the inference layout is *usable*, not a serving engine (no KV cache).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from streamrl.reshard.spec import ModelShardingSpec


def rope_theta(config: Any) -> float:
    """RoPE base of a transformers config (``rope_parameters`` in transformers 5, ``rope_theta`` before)."""
    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        raise ValueError(
            f"tensor_parallel_logits supports default RoPE only, got {params.get('rope_type')!r}"
        )
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("the config has no rope_theta")
    return float(theta)


def default_rope_inv_freq(theta: float, head_dim: int, device: torch.device | None = None) -> torch.Tensor:
    """Default RoPE inverse frequencies [head_dim / 2] (float32), the Hugging Face formula."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # the HF recipe: normalise in float32, scale in the input dtype
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(x, group=group)
    return x


@torch.no_grad()
def tensor_parallel_logits(
    weights: Mapping[str, torch.Tensor],
    spec: ModelShardingSpec,
    input_ids: torch.Tensor,
    *,
    rope_theta: float,
    rms_norm_eps: float,
    inference_rank: int,
    tensor_parallel: int,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Full-vocabulary logits [batch, seq, vocab] of the model held as T inference shards.

    ``weights`` is this rank's slice (names and shapes of ``spec.inference_plan(T).shapes``);
    every rank of ``group`` calls this with the same ``input_ids``.
    """
    T, t = tensor_parallel, inference_rank
    d = spec.head_dim
    qh, kh = spec.num_heads // T, max(1, spec.num_kv_heads // T)
    batch, seq = input_ids.shape
    vocab_rows = spec.padded_vocab(T) // T

    # vocab-parallel embedding: each rank looks up the ids it owns, zeros elsewhere, then sum
    local = input_ids - t * vocab_rows
    owned = (local >= 0) & (local < vocab_rows)
    embed = weights["model.embed_tokens.weight"]
    h = F.embedding(local.clamp(0, vocab_rows - 1), embed) * owned.unsqueeze(-1).to(embed.dtype)
    h = _all_reduce(h, group)

    inv_freq = default_rope_inv_freq(rope_theta, d, h.device)
    freqs = torch.arange(seq, dtype=torch.float32, device=h.device)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(h.dtype), emb.sin().to(h.dtype)

    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        x = _rms_norm(h, weights[p + "input_layernorm.weight"], rms_norm_eps)
        qkv = F.linear(
            x, weights[p + "self_attn.qkv_proj.weight"], weights.get(p + "self_attn.qkv_proj.bias")
        )
        q, k, v = qkv.split([qh * d, kh * d, kh * d], dim=-1)
        q = q.view(batch, seq, qh, d).transpose(1, 2)
        k = k.view(batch, seq, kh, d).transpose(1, 2)
        v = v.view(batch, seq, kh, d).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        k = k.repeat_interleave(qh // kh, dim=1)
        v = v.repeat_interleave(qh // kh, dim=1)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        attn = attn.transpose(1, 2).reshape(batch, seq, qh * d)
        out = _all_reduce(F.linear(attn, weights[p + "self_attn.o_proj.weight"]), group)
        bias = weights.get(p + "self_attn.o_proj.bias")
        h = h + (out if bias is None else out + bias)  # a replicated bias is added once, after the sum
        x = _rms_norm(h, weights[p + "post_attention_layernorm.weight"], rms_norm_eps)
        gate, up = F.linear(x, weights[p + "mlp.gate_up_proj.weight"]).chunk(2, dim=-1)
        h = h + _all_reduce(F.linear(F.silu(gate) * up, weights[p + "mlp.down_proj.weight"]), group)

    h = _rms_norm(h, weights["model.norm.weight"], rms_norm_eps)
    logits = F.linear(h, weights["lm_head.weight"]).contiguous()
    if group is not None:
        parts = [torch.empty_like(logits) for _ in range(T)]
        dist.all_gather(parts, logits, group=group)
        logits = torch.cat(parts, dim=-1)
    return logits[..., : spec.vocab_size]
