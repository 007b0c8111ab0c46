"""A compact functional forward for the Llama / Qwen2 / Mistral decoder family.

Why: on a small CPU the Hugging Face forward spends most of its time in Python (mask
construction, cache objects, output dataclasses), not in matrix products. This forward does
the same maths with a few dozen torch ops per layer, and it works on *packed* tokens: the
linear layers see only real tokens (no padding), only attention sees a padded [B, heads, L, d]
view. Both the rollout engine (with a KV cache) and the train engine (with autograd) use it.

It reads the Hugging Face module's own parameters on every call (no copies), so an optimizer
step or ``load_state_dict`` on the module is seen by the next call. ``unsupported_reason``
says when a model needs the Hugging Face forward instead (other architectures or options);
the engines fall back to it. Equivalence with the HF logits is checked in
``tests/models/test_functional.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# model_type -> whether the architecture is the plain pre-norm RMSNorm / RoPE / GQA / SwiGLU decoder.
SUPPORTED_MODEL_TYPES = frozenset({"qwen2", "llama", "mistral"})
# RoPE variants whose inverse frequencies do not depend on the sequence length (static tables).
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3"})


class UnsupportedModelError(ValueError):
    """The functional forward cannot run this model; use the Hugging Face forward."""


def unsupported_reason(model: nn.Module) -> str | None:
    """Why ``FunctionalCausalLM`` cannot run ``model``, or None when it can."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {sorted(SUPPORTED_MODEL_TYPES)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (only silu/SwiGLU)"
    layer_types = getattr(config, "layer_types", None) or []
    windowed = bool(getattr(config, "sliding_window", None)) and (
        model_type == "mistral" or bool(getattr(config, "use_sliding_window", False))
    )
    if windowed or any(t != "full_attention" for t in layer_types):
        return "sliding-window attention"
    inner = getattr(model, "model", None)
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        return "no rotary_emb.inv_freq buffer"
    if getattr(rotary, "rope_type", "default") not in STATIC_ROPE_TYPES:
        return f"rope_type {rotary.rope_type!r} (only {sorted(STATIC_ROPE_TYPES)})"
    layers = getattr(inner, "layers", None)
    if layers is None or len(layers) == 0:
        return "no decoder layers"
    attn = layers[0].self_attn
    if any(hasattr(attn, name) for name in ("q_norm", "k_norm")):
        return "q/k normalisation in attention"
    if not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return "attention without q/k/v/o projections"
    return None


@dataclass(frozen=True)
class Packing:
    """Where the real tokens of a right-padded [B, L] batch sit in the flat [B*L] layout."""

    batch: int
    length: int  # padded length L (tokens)
    flat_index: Tensor | None  # [T] positions of real tokens in [B*L]; None = no padding at all
    positions: Tensor  # [T] RoPE position of each real token (0 = its sequence's first token)

    @staticmethod
    def from_lengths(lengths: Tensor, length: int) -> Packing:
        batch = lengths.numel()
        steps = torch.arange(length, device=lengths.device)
        if bool((lengths == length).all()):
            return Packing(batch, length, None, steps.repeat(batch))
        valid = (steps.unsqueeze(0) < lengths.unsqueeze(1)).reshape(-1)
        flat_index = valid.nonzero().squeeze(1)
        return Packing(batch, length, flat_index, flat_index % length)

    def pad(self, packed: Tensor) -> Tensor:
        """[T, ...] -> [B, L, ...] with zeros in the padding."""
        if self.flat_index is None:
            return packed.view(self.batch, self.length, *packed.shape[1:])
        full = packed.new_zeros(self.batch * self.length, *packed.shape[1:])
        return full.index_copy(0, self.flat_index, packed).view(self.batch, self.length, *packed.shape[1:])

    def unpad(self, padded: Tensor) -> Tensor:
        """[B, L, ...] -> [T, ...]."""
        flat = padded.reshape(self.batch * self.length, *padded.shape[2:])
        return flat if self.flat_index is None else flat.index_select(0, self.flat_index)


class KVCache:
    """Per-layer key/value buffers [rows, kv_heads, columns, head_dim], reused across calls.

    Rows are sequences; a sequence's tokens sit at columns 0..n-1 (its RoPE positions), so
    columns beyond a row's length are masked in attention, never read as real keys.
    Why reuse: first-touching a fresh multi-MB buffer (page faults + zero fill) cost more than
    a whole decode step on CPU. Columns left over from an earlier call hold finite keys/values
    of that call (buffers start zeroed), and the mask gives them weight exactly 0.
    """

    def __init__(self, n_layers: int, kv_heads: int, head_dim: int, *, dtype: torch.dtype, device: torch.device):
        self.n_layers, self.kv_heads, self.head_dim = n_layers, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []
        self.rows = 0  # rows in use: 0..rows-1

    def reserve(self, rows: int, columns: int) -> None:
        """Make room for ``rows`` sequences of ``columns`` tokens; rows in use = ``rows``."""
        have_rows = self.keys[0].shape[0] if self.keys else 0
        have_cols = self.keys[0].shape[2] if self.keys else 0
        if rows > have_rows or columns > have_cols or self.keys[0].dtype != self.dtype:
            shape = (max(rows, have_rows), self.kv_heads, max(columns, have_cols), self.head_dim)
            self.release()
            self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.n_layers)]
            self.values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.n_layers)]
        self.rows = rows

    def release(self) -> None:
        """Free the buffers (e.g. before handing device memory to training)."""
        self.keys, self.values, self.rows = [], [], 0

    def layer(self, i: int) -> tuple[Tensor, Tensor]:
        """Views [rows, kv_heads, all columns, head_dim] of layer ``i``."""
        return self.keys[i][: self.rows], self.values[i][: self.rows]

    def select_rows(self, keep: Tensor, columns: int) -> None:
        """Keep only rows ``keep`` (ascending), moved to the front; copies only ``columns`` columns."""
        m = keep.numel()
        for buf in (*self.keys, *self.values):
            buf[:m, :, :columns] = buf[keep, :, :columns]
        self.rows = m


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class FunctionalCausalLM:
    """Forward passes for a Hugging Face Llama-family ``*ForCausalLM`` module, read in place."""

    def __init__(self, model: nn.Module) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise UnsupportedModelError(f"functional forward cannot run this model: {reason}")
        self.module = model
        config = model.config
        self.n_heads: int = config.num_attention_heads
        self.n_kv_heads: int = config.num_key_value_heads or self.n_heads
        self.head_dim: int = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        self.hidden: int = config.hidden_size
        self.eps: float = config.rms_norm_eps
        self.n_layers: int = len(model.model.layers)
        self._rotary = model.model.rotary_emb

    # --- building blocks -------------------------------------------------------------------
    def rope_tables(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin [N, 1, head_dim] for integer ``positions`` [N] (same formula as HF)."""
        inv_freq = self._rotary.inv_freq.to(device=positions.device, dtype=torch.float32)
        freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = float(getattr(self._rotary, "attention_scaling", 1.0))
        cos, sin = emb.cos(), emb.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)

    def _embed(self, ids: Tensor) -> Tensor:
        embed = self.module.model.embed_tokens
        # padding_idx as nn.Embedding: the pad row gets no gradient, as in the HF forward.
        return F.embedding(ids, embed.weight, padding_idx=embed.padding_idx)

    def _norm(self, x: Tensor, norm: nn.Module) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)

    def _qkv(self, layer: nn.Module, h: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """[N, hidden] -> q [N, heads, d], k, v [N, kv_heads, d], RoPE applied to q and k."""
        attn = layer.self_attn
        n = h.shape[0]
        q = F.linear(h, attn.q_proj.weight, attn.q_proj.bias).view(n, self.n_heads, self.head_dim)
        k = F.linear(h, attn.k_proj.weight, attn.k_proj.bias).view(n, self.n_kv_heads, self.head_dim)
        v = F.linear(h, attn.v_proj.weight, attn.v_proj.bias).view(n, self.n_kv_heads, self.head_dim)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q, k, v

    def _mlp_and_out(self, layer: nn.Module, x: Tensor, attn_out: Tensor) -> Tensor:
        """Residual add of the attention output, then the SwiGLU MLP block."""
        attn = layer.self_attn
        x = x + F.linear(attn_out, attn.o_proj.weight, attn.o_proj.bias)
        mlp = layer.mlp
        h = self._norm(x, layer.post_attention_layernorm)
        gate = F.linear(h, mlp.gate_proj.weight, mlp.gate_proj.bias)
        up = F.linear(h, mlp.up_proj.weight, mlp.up_proj.bias)
        return x + F.linear(F.silu(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, **kwargs: object) -> Tensor:
        if self.n_kv_heads != self.n_heads:
            rep = self.n_heads // self.n_kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, **kwargs)  # type: ignore[arg-type]

    def logits(self, hidden: Tensor) -> Tensor:
        """Final norm + lm_head on pre-norm hidden states [N, hidden] -> [N, vocab]."""
        model = self.module
        h = self._norm(hidden, model.model.norm)
        return F.linear(h, model.lm_head.weight, getattr(model.lm_head, "bias", None))

    # --- whole sequences (training, prefill) -------------------------------------------------
    def forward_packed(
        self,
        input_ids: Tensor,
        lengths: Tensor,
        *,
        cache: KVCache | None = None,
        cache_rows: Tensor | None = None,
    ) -> tuple[Tensor, Packing]:
        """Pre-norm hidden states [T, hidden] of every real token of a right-padded batch.

        ``input_ids`` [B, L] right-padded, ``lengths`` [B] real tokens per row (≥ 1). Each row
        starts at RoPE position 0. With ``cache``, the keys/values of the B rows are written to
        cache rows ``cache_rows[j]`` for cache row j (a row may feed several cache rows: prompt
        sharing); columns 0..L-1. The cache must have ``reserve``d len(cache_rows) (or B) rows.
        """
        model = self.module
        length = input_ids.shape[1]
        pack = Packing.from_lengths(lengths, length)
        ids = input_ids.reshape(-1) if pack.flat_index is None else input_ids.reshape(-1)[pack.flat_index]
        x = self._embed(ids)
        cos, sin = self.rope_tables(pack.positions, x.dtype)
        for i, layer in enumerate(model.model.layers):
            h = self._norm(x, layer.input_layernorm)
            q, k, v = self._qkv(layer, h, cos, sin)
            kp, vp = pack.pad(k), pack.pad(v)  # [B, L, kv_heads, d]
            if cache is not None:
                keys, values = cache.layer(i)
                if cache_rows is None:
                    keys[:, :, :length] = kp.transpose(1, 2)
                    values[:, :, :length] = vp.transpose(1, 2)
                else:
                    keys[:, :, :length] = kp.index_select(0, cache_rows).transpose(1, 2)
                    values[:, :, :length] = vp.index_select(0, cache_rows).transpose(1, 2)
            # Right padding + causal mask: a real query only ever sees real keys before it.
            out = self._sdpa(pack.pad(q).transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2), is_causal=True)
            attn_out = pack.unpad(out.transpose(1, 2)).reshape(-1, self.n_heads * self.head_dim)
            x = self._mlp_and_out(layer, x, attn_out)
        return x, pack

    # --- prompts shared by several continuations (GRPO groups) --------------------------------
    def forward_shared_prompts(
        self,
        prompt_ids: Tensor,
        prompt_lengths: Tensor,
        cont_ids: Tensor,
        cont_lengths: Tensor,
        prompt_of: Tensor,
    ) -> tuple[Tensor, Packing, Packing]:
        """Hidden states of U distinct prompts and B continuations, each prompt computed once.

        Why: a GRPO group is n completions of one prompt, so a plain batch computes every prompt
        n times in the forward *and* the backward. Here each distinct prompt runs once; the
        continuations attend to its keys/values through an index, and autograd sums their
        gradients into it. Values and gradients equal the plain computation.

        ``prompt_ids`` [U, Lp] and ``cont_ids`` [B, Lc] right-padded, ``prompt_lengths`` [U] ≥ 1,
        ``cont_lengths`` [B] ≥ 0, ``prompt_of`` [B] the prompt row of each continuation.
        Returns pre-norm hidden [T_p + T_c, hidden] (prompt tokens first, then continuation
        tokens, each packed row by row) and the two packings.
        """
        model = self.module
        _n_prompts, p_len = prompt_ids.shape
        batch, c_len = cont_ids.shape
        p_pack = Packing.from_lengths(prompt_lengths, p_len)
        c_pack = Packing.from_lengths(cont_lengths, c_len)
        n_p = p_pack.positions.numel()
        p_flat = prompt_ids.reshape(-1) if p_pack.flat_index is None else prompt_ids.reshape(-1)[p_pack.flat_index]
        c_flat = cont_ids.reshape(-1) if c_pack.flat_index is None else cont_ids.reshape(-1)[c_pack.flat_index]
        x = self._embed(torch.cat([p_flat, c_flat]))
        # A continuation token's RoPE position continues its prompt: prompt_len + offset.
        c_row = torch.arange(batch, device=x.device).repeat_interleave(cont_lengths)
        c_positions = prompt_lengths.index_select(0, prompt_of)[c_row] + c_pack.positions
        cos, sin = self.rope_tables(torch.cat([p_pack.positions, c_positions]), x.dtype)
        # Continuation queries see their prompt's real keys, then their own keys causally.
        columns = torch.arange(p_len, device=x.device)
        sees_prompt = (columns.unsqueeze(0) < prompt_lengths.index_select(0, prompt_of).unsqueeze(1))  # [B, Lp]
        causal = torch.ones(c_len, c_len, dtype=torch.bool, device=x.device).tril()
        mask = torch.cat(
            [sees_prompt.unsqueeze(1).expand(batch, c_len, p_len), causal.unsqueeze(0).expand(batch, c_len, c_len)],
            dim=2,
        ).unsqueeze(1)  # [B, 1, Lc, Lp + Lc]
        width = self.n_heads * self.head_dim
        for layer in model.model.layers:
            h = self._norm(x, layer.input_layernorm)
            q, k, v = self._qkv(layer, h, cos, sin)
            kp = p_pack.pad(k[:n_p]).transpose(1, 2)  # [U, kv_heads, Lp, d]
            vp = p_pack.pad(v[:n_p]).transpose(1, 2)
            out_p = self._sdpa(p_pack.pad(q[:n_p]).transpose(1, 2), kp, vp, is_causal=True)
            parts = [p_pack.unpad(out_p.transpose(1, 2)).reshape(-1, width)]
            if c_len > 0:
                keys = torch.cat([kp.index_select(0, prompt_of), c_pack.pad(k[n_p:]).transpose(1, 2)], dim=2)
                values = torch.cat([vp.index_select(0, prompt_of), c_pack.pad(v[n_p:]).transpose(1, 2)], dim=2)
                out_c = self._sdpa(c_pack.pad(q[n_p:]).transpose(1, 2), keys, values, attn_mask=mask)
                parts.append(c_pack.unpad(out_c.transpose(1, 2)).reshape(-1, width))
            x = self._mlp_and_out(layer, x, torch.cat(parts) if len(parts) > 1 else parts[0])
        return x, p_pack, c_pack

    # --- one new token per row (decoding) ------------------------------------------------------
    def decode_step(self, token_ids: Tensor, positions: Tensor, cache: KVCache, n_keys: int) -> Tensor:
        """Logits [B, vocab] for one new token per cache row (B = cache.rows).

        ``token_ids`` [B], ``positions`` [B] (the column each row writes, = its RoPE position),
        ``n_keys`` > max(positions): the columns attention reads (later ones are not filled yet).
        """
        model = self.module
        batch = token_ids.shape[0]
        rep = self.n_heads // self.n_kv_heads
        x = self._embed(token_ids)
        cos, sin = self.rope_tables(positions, x.dtype)
        rows = torch.arange(batch, device=x.device)
        columns = torch.arange(n_keys, device=x.device)
        # Additive mask [B, 1, 1, n_keys]: 0 for a row's own columns 0..position, -inf beyond.
        hidden_key = columns.unsqueeze(0) > positions.unsqueeze(1)
        mask = torch.zeros(hidden_key.shape, dtype=x.dtype, device=x.device).masked_fill_(hidden_key, float("-inf"))
        mask = mask.view(batch, 1, 1, n_keys)
        scale = self.head_dim**-0.5
        for i, layer in enumerate(model.model.layers):
            h = self._norm(x, layer.input_layernorm)
            q, k, v = self._qkv(layer, h, cos, sin)
            keys, values = cache.layer(i)
            keys[rows, :, positions] = k
            values[rows, :, positions] = v
            # One query per row: plain matmuls beat the SDPA kernel here (measured), and grouping
            # the query heads per kv head does GQA without repeating keys.
            q = q.view(batch, self.n_kv_heads, rep, self.head_dim)
            scores = torch.matmul(q, keys[:, :, :n_keys].transpose(-1, -2)) * scale + mask
            out = torch.matmul(torch.softmax(scores, dim=-1), values[:, :, :n_keys])
            x = self._mlp_and_out(layer, x, out.reshape(batch, self.n_heads * self.head_dim))
        return self.logits(x)
