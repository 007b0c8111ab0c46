"""A compact functional forward for the Llama / Qwen2 / Mistral decoder family, for generation.

The built-in rollout engines (:class:`streamrl.engines.rollout.BatchedRolloutEngine` and its
tensor-parallel subclass) sample with it: a packed prefill (:meth:`FunctionalForward.forward_packed`:
the linear layers see only real tokens, only attention sees a padded [B, heads, L, d] view) and
one-token decoding steps over a :class:`KVCache` that keeps each distinct prompt once. On a small
CPU the Hugging Face forward spends most of its time in Python (mask construction, cache
objects, output dataclasses); this one does the same maths with a few dozen torch ops per layer.

:class:`FunctionalCausalLM` reads the Hugging Face module's parameters when it is built (its fused
projections are copies), so the rollout engine builds one per call.
``unsupported_reason`` says when a model needs the Hugging Face forward instead (a model type
outside ``SUPPORTED_MODEL_TYPES``, or options such as a sliding window); the engines fall back to
it. Equivalence with the HF logits is checked in ``tests/models/test_functional.py``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from streamrl.models.matmul_precision import ieee_attention, ieee_matmuls
from streamrl.reshard.spec import SUPPORTED_MODEL_TYPES

# RoPE variants whose inverse frequencies do not depend on the sequence length (static tables).
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3"})


class UnsupportedModelError(ValueError):
    """The functional forward cannot run this model; use the Hugging Face forward."""


def unsupported_config_reason(config: object) -> str | None:
    """Why the functional forward cannot run a model of this transformers config, or None.

    The checks that need only the config; ``unsupported_reason`` adds those that need the module.
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {sorted(SUPPORTED_MODEL_TYPES)}"
    hidden_act = getattr(config, "hidden_act", "silu")
    if hidden_act != "silu":
        return f"hidden_act {hidden_act!r} (only silu/SwiGLU)"
    layer_types = getattr(config, "layer_types", None) or []
    windowed = bool(getattr(config, "sliding_window", None)) and (
        model_type == "mistral" or bool(getattr(config, "use_sliding_window", False))
    )
    if windowed or any(t != "full_attention" for t in layer_types):
        return "sliding-window attention"
    return None


def unsupported_reason(model: nn.Module) -> str | None:
    """Why ``FunctionalCausalLM`` cannot run ``model``, or None when it can."""
    reason = unsupported_config_reason(getattr(model, "config", None))
    if reason is not None:
        return reason
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
    """Keys/values of sequences that continue a few distinct prompts (GRPO: n samples per prompt).

    Each distinct prompt's keys/values are kept once ([U, kv_heads, Lp, head_dim] per layer) and
    each sequence's generated ones apart, time-major ([T, rows, kv_heads, head_dim]: column t =
    every row's t-th generated token, written by one step). Why: decoding is bound by reading the
    cache; with one copy of the prompt per group instead of one per row, a step reads n-fold less
    prompt keys, and the generated columns a step reads are one contiguous block, which a cache
    evicted since the layer's last step streams back at memory speed (a row-major cache read as a
    thousand short pieces took twice as long; docs/benchmarks.md §44).

    The generated-token buffers are reused across calls: first-touching a fresh multi-MB
    buffer (page faults, zero fill) costs more than a decode step on CPU. Columns are only
    read once written in the current call.
    """

    def __init__(self, n_layers: int, kv_heads: int, head_dim: int, *, dtype: torch.dtype, device: torch.device):
        self.n_layers, self.kv_heads, self.head_dim = n_layers, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.prompt_keys: list[Tensor] = []  # per layer [U, kv_heads, Lp, d]
        self.prompt_values: list[Tensor] = []
        self.prompt_mask = torch.zeros(0)  # [U, Lp] additive: 0 = real key, -inf = padding
        self.row_mask = torch.zeros(0)  # [rows, Lp + columns] additive, per row: its prompt's, then 0s
        self.gen_keys: list[Tensor] = []  # per layer [capacity columns, capacity rows, kv_heads, d]
        self.gen_values: list[Tensor] = []
        self.rows = 0
        self.columns = 0  # generated columns this call may write
        self.row_prompt = torch.zeros(0, dtype=torch.int64)  # [rows] prompt of each row
        self.group_slot = torch.zeros(0, dtype=torch.int64)  # [rows] rank of the row among its prompt's rows
        self.group_width = 0  # most rows sharing one prompt
        # True when row r continues prompt r // group_width for every r (each prompt's rows side by
        # side, all groups full): a decode step then groups rows by prompt with views, not scatters.
        self.regular = False
        self._row_prompt_host: list[int] = []

    def start(
        self, prompt_kv: list[tuple[Tensor, Tensor]], prompt_lengths: Tensor, row_prompt: list[int], columns: int
    ) -> None:
        """Begin a call: prompt keys/values per layer ([U, kv_heads, Lp, d]), rows -> prompt, T columns."""
        # the cache's dtype, where a half-precision model's attention computes in float32 (attention_dtype)
        self.prompt_keys = [k.to(self.dtype) for k, _ in prompt_kv]
        self.prompt_values = [v.to(self.dtype) for _, v in prompt_kv]
        width = self.prompt_keys[0].shape[2]
        hidden = torch.arange(width, device=self.device).unsqueeze(0) >= prompt_lengths.unsqueeze(1)
        self.prompt_mask = torch.zeros(hidden.shape, dtype=self.dtype, device=self.device).masked_fill_(
            hidden, float("-inf")
        )
        self.columns = max(columns, 1)
        rows = len(row_prompt)
        have_cols = self.gen_keys[0].shape[0] if self.gen_keys else 0
        have_rows = self.gen_keys[0].shape[1] if self.gen_keys else 0
        if rows > have_rows or columns > have_cols:
            shape = (max(columns, have_cols, 1), max(rows, have_rows), self.kv_heads, self.head_dim)
            self.gen_keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.n_layers)]
            self.gen_values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.n_layers)]
        self._set_rows(row_prompt)

    def _set_rows(self, row_prompt: list[int]) -> None:
        seen: dict[int, int] = {}
        slots = []
        for u in row_prompt:
            slots.append(seen.get(u, 0))
            seen[u] = slots[-1] + 1
        self._row_prompt_host = row_prompt
        self.rows = len(row_prompt)
        self.group_width = max(seen.values(), default=0)
        n_prompts = self.prompt_mask.shape[0]
        self.regular = self.rows == n_prompts * self.group_width and all(
            u == r // self.group_width for r, u in enumerate(row_prompt)
        )
        self.row_prompt = torch.tensor(row_prompt, dtype=torch.int64, device=self.device)
        self.group_slot = torch.tensor(slots, dtype=torch.int64, device=self.device)
        # Built once per call (and per compaction) rather than per decode step; a step reads a prefix.
        self.row_mask = torch.cat(
            [self.prompt_mask.index_select(0, self.row_prompt), self.prompt_mask.new_zeros(self.rows, self.columns)],
            dim=1,
        )

    def select_rows(self, keep: list[int], columns: int) -> None:
        """Keep only rows ``keep`` (ascending), moved to the front; copies ``columns`` generated columns."""
        index = torch.tensor(keep, dtype=torch.int64, device=self.device)
        m = len(keep)
        for buf in (*self.gen_keys, *self.gen_values):
            buf[:columns, :m] = buf[:columns].index_select(1, index)
        self._set_rows([self._row_prompt_host[r] for r in keep])

    def release(self) -> None:
        """Free the buffers (e.g. before handing device memory to training)."""
        self.prompt_keys, self.prompt_values, self.gen_keys, self.gen_values = [], [], [], []
        self.rows = 0


def swap_halves(x: Tensor) -> Tensor:
    """[..., d] -> [..., d] with the two halves of the last dim swapped (one copy; ``roll`` is the
    cheapest kernel for it on CPU, ahead of ``cat`` of the halves and ``flip``)."""
    return x.roll(x.shape[-1] // 2, -1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on [N, heads, head_dim] with tables [N, 1, head_dim] from ``rope_tables``.

    HF's formula is ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = [-x2, x1]``;
    ``rope_tables`` returns ``sin`` with its first half negated, so the same value is
    ``x * cos + [x2, x1] * sin``: three kernels instead of five (no ``neg``), equal up to float
    rounding (``addcmul`` may fuse its multiply-add).
    """
    return torch.addcmul(x * cos, swap_halves(x), sin)


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One decoder layer's weights in the fused inference layout.

    ``qkv`` stacks the q, k and v projections by rows and ``gate_up`` the gate and up
    projections (vLLM's layout, ``docs/reshard.md`` §2): one matmul each instead of three and two,
    and q and k side by side in one output, so RoPE runs once on both. A tensor-parallel rank
    holds its slice of each.
    """

    input_norm: Tensor
    qkv: Tensor  # [(q heads + 2 kv heads) * d, hidden]
    qkv_bias: Tensor | None
    o_proj: Tensor  # [hidden, q heads * d]
    o_bias: Tensor | None  # added after the tensor-parallel sum (a replicated bias counts once)
    post_norm: Tensor
    gate_up: Tensor  # [2 * intermediate, hidden]
    gate_up_bias: Tensor | None
    down: Tensor  # [hidden, intermediate]
    down_bias: Tensor | None


class FunctionalForward(ABC):
    """The forward passes (packed prefill, cached decoding) over a few building blocks.

    Why a base: the passes are the same whoever holds the weights; a subclass says where the
    weights are (``_layer_weights``, ``_embed``, ``logits``). ``FunctionalCausalLM`` reads a
    Hugging Face module; ``streamrl.engines.tp_rollout.TensorParallelFunctionalLM`` reads one
    tensor-parallel rank's fused inference weights and adds the collectives (``_all_reduce``).
    The passes only see the head counts below, which for a TP rank are its local ones.
    """

    n_heads: int  # query heads this forward computes
    n_kv_heads: int  # key/value heads this forward computes (and caches)
    head_dim: int
    hidden: int
    eps: float  # RMSNorm epsilon
    n_layers: int

    # --- building blocks -------------------------------------------------------------------
    @abstractmethod
    def _rope_frequencies(self) -> tuple[Tensor, float]:
        """RoPE inverse frequencies [head_dim / 2] and the attention scaling of cos/sin."""

    @abstractmethod
    def _layer_weights(self) -> list[LayerWeights]:
        """Every layer's weights in the fused layout (asked once per pass)."""

    @abstractmethod
    def _embed(self, ids: Tensor) -> Tensor:
        """Token ids [N] -> embeddings [N, hidden]."""

    @abstractmethod
    def logits(self, hidden: Tensor) -> Tensor:
        """Final norm + lm_head on pre-norm hidden states [N, hidden] -> [N, vocab]."""

    def _all_reduce(self, x: Tensor) -> Tensor:
        """Sum a row-parallel partial product over the tensor-parallel group (none here)."""
        return x

    def rope_tables(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin [N, 1, head_dim] for integer ``positions`` [N] (HF's formula), the first half
        of ``sin`` negated: the form ``apply_rope`` takes."""
        inv_freq, scale = self._rope_frequencies()
        inv_freq = inv_freq.to(device=positions.device, dtype=torch.float32)
        freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        sin[:, : inv_freq.numel()].neg_()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)

    def _norm(self, x: Tensor, weight: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)

    def _qkv(self, w: LayerWeights, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Input RMSNorm of the residual stream [N, hidden], then q [N, heads, d], k, v [N, kv_heads, d]
        (views of one matmul's output), RoPE applied to q and k together."""
        h = self._norm(x, w.input_norm)
        n, d = h.shape[0], self.head_dim
        qkv = F.linear(h, w.qkv, w.qkv_bias)
        roped = self.n_heads + self.n_kv_heads
        qk = apply_rope(qkv[:, : roped * d].view(n, roped, d), cos, sin)
        return qk[:, : self.n_heads], qk[:, self.n_heads :], qkv[:, roped * d :].view(n, self.n_kv_heads, d)

    def _mlp_and_out(self, w: LayerWeights, x: Tensor, attn_out: Tensor) -> Tensor:
        """Residual add of the projected attention output [N, heads*d], then the MLP block."""
        out = self._all_reduce(F.linear(attn_out, w.o_proj))
        x = x + (out if w.o_bias is None else out + w.o_bias)
        h = self._norm(x, w.post_norm)
        gate, up = F.linear(h, w.gate_up, w.gate_up_bias).chunk(2, dim=-1)
        down = self._all_reduce(F.linear(F.silu(gate) * up, w.down))
        return x + (down if w.down_bias is None else down + w.down_bias)

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, **kwargs: object) -> Tensor:
        if self.n_kv_heads != self.n_heads:
            rep = self.n_heads // self.n_kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        return ieee_attention(F.scaled_dot_product_attention, q, k, v, **kwargs)

    # --- whole sequences (prefill) -------------------------------------------------
    def forward_packed(
        self,
        input_ids: Tensor,
        lengths: Tensor,
        *,
        kv_out: list[tuple[Tensor, Tensor]] | None = None,
    ) -> tuple[Tensor, Packing]:
        """Pre-norm hidden states [T, hidden] of every real token of a right-padded batch.

        ``input_ids`` [B, L] right-padded, ``lengths`` [B] real tokens per row (≥ 1). Each row
        starts at RoPE position 0. With ``kv_out``, each layer's keys and values are appended to
        it as [B, kv_heads, L, head_dim] (padding positions hold zeros), for a KV cache.
        """
        length = input_ids.shape[1]
        pack = Packing.from_lengths(lengths, length)
        ids = input_ids.reshape(-1) if pack.flat_index is None else input_ids.reshape(-1)[pack.flat_index]
        x = self._embed(ids)
        cos, sin = self.rope_tables(pack.positions, x.dtype)
        for w in self._layer_weights():
            q, k, v = self._qkv(w, x, cos, sin)
            kp, vp = pack.pad(k), pack.pad(v)  # [B, L, kv_heads, d]
            if kv_out is not None:
                kv_out.append((kp.transpose(1, 2).contiguous(), vp.transpose(1, 2).contiguous()))
            # Right padding + causal mask: a real query only ever sees real keys before it.
            out = self._sdpa(pack.pad(q).transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2), is_causal=True)
            attn_out = pack.unpad(out.transpose(1, 2)).reshape(-1, self.n_heads * self.head_dim)
            x = self._mlp_and_out(w, x, attn_out)
        return x, pack

    # --- one new token per row (decoding) ------------------------------------------------------
    def decode_step(self, token_ids: Tensor, positions: Tensor, cache: KVCache, step: int) -> Tensor:
        """Logits [B, vocab] for the ``step``-th generated token of each cache row (B = cache.rows).

        ``token_ids`` [B], ``positions`` [B] their RoPE positions (prompt length + step). The
        cache holds generated columns 0..step-1; this call writes column ``step``.

        Each row's query meets its prompt's keys (kept once per prompt) and its own generated
        keys. The prompt part is one matmul per prompt over the queries of all its rows, so rows
        are grouped by prompt around it: with views when the cache's rows are ``regular`` (each
        prompt's rows side by side, the usual GRPO batch until finished rows are dropped), else by
        a scatter and a gather. Rows then stay shaped ``row_shape`` ([U, n] or [B]) until the
        attention output.
        """
        batch = token_ids.shape[0]
        n_prompts = cache.prompt_mask.shape[0]
        width = cache.group_width
        rep = self.n_heads // self.n_kv_heads
        kvh, d = self.n_kv_heads, self.head_dim
        x = self._embed(token_ids)
        cos, sin = self.rope_tables(positions, x.dtype)
        p_len = cache.prompt_mask.shape[1]
        row_shape = (n_prompts, width) if cache.regular else (batch,)
        mask = cache.row_mask[:, : p_len + step + 1].view(*row_shape, 1, 1, -1)  # [rows, 1, 1, Lp + step + 1]
        where = (cache.row_prompt, cache.group_slot)
        scale = d**-0.5

        def by_prompt(t: Tensor) -> Tensor:
            """[*row_shape, kvh, rep, n] -> [U, kvh, width*rep, n]: each prompt's rows side by side."""
            if cache.regular:
                return t.transpose(1, 2).reshape(n_prompts, kvh, width * rep, t.shape[-1])
            grouped = t.new_zeros(n_prompts, width, kvh, rep, t.shape[-1])
            grouped[where] = t
            return grouped.permute(0, 2, 1, 3, 4).reshape(n_prompts, kvh, width * rep, t.shape[-1])

        def by_row(t: Tensor) -> Tensor:
            """Inverse of by_prompt (a view when regular)."""
            grouped = t.view(n_prompts, kvh, width, rep, t.shape[-1]).permute(0, 2, 1, 3, 4)
            return grouped if cache.regular else grouped[where]

        for i, w in enumerate(self._layer_weights()):
            q, k, v = self._qkv(w, x, cos, sin)
            cache.gen_keys[i][step, :batch] = k
            cache.gen_values[i][step, :batch] = v
            gen_k = cache.gen_keys[i][: step + 1, :batch]  # [step + 1, B, kvh, d]
            gen_v = cache.gen_values[i][: step + 1, :batch]
            # Query heads grouped per kv head (GQA without repeating keys); plain matmuls for the
            # prompt part, not the SDPA kernel, which is slower for one query per row.
            q = q.view(batch, kvh, rep, d).to(cache.dtype)  # float32 for a half-precision model on a CPU
            with ieee_matmuls():  # one query per row: too small for a lowered matmul precision's path
                q_rows = q.view(*row_shape, kvh, rep, d)
                s_prompt = by_row(torch.matmul(by_prompt(q_rows), cache.prompt_keys[i].transpose(-1, -2)))
                s_gen = _generated_scores(gen_k, q).permute(1, 2, 3, 0).view(*row_shape, kvh, rep, step + 1)
                p = torch.softmax(torch.add(mask, torch.cat([s_prompt, s_gen], dim=-1), alpha=scale), dim=-1)
                p_prompt, p_gen = p.split([p_len, step + 1], dim=-1)
                p_gen = p_gen.reshape(batch, kvh, rep, step + 1).permute(3, 0, 1, 2)
                out_gen = _generated_sum(gen_v, p_gen).view(*row_shape, kvh, rep, d)
                out = by_row(torch.matmul(by_prompt(p_prompt), cache.prompt_values[i])) + out_gen
            x = self._mlp_and_out(w, x, out.reshape(batch, self.n_heads * d).to(x.dtype))
        return self.logits(x)


def _generated_scores(keys: Tensor, q: Tensor) -> Tensor:
    """[T, B, kvh, rep]: each row's query heads q [B, kvh, rep, d] against its generated keys
    [T, B, kvh, d] (time-major).

    On a CPU as products summed: one streaming pass over the keys, where a batched matmul is B x kvh
    matrix-vector products, each over a piece of a cache evicted since the layer's last step (twice
    as slow, docs/benchmarks.md §44). Elsewhere one batched matmul, which also sums the products
    unrounded in a half-precision cache."""
    if keys.device.type == "cpu":
        return (keys.unsqueeze(3) * q).sum(-1)
    return torch.einsum("tbhd,bhrd->tbhr", keys, q)


def _generated_sum(values: Tensor, p: Tensor) -> Tensor:
    """[B, kvh, rep, d]: generated values [T, B, kvh, d] weighted by p [T, B, kvh, rep] and summed over
    T (as :func:`_generated_scores`, products summed on a CPU)."""
    if values.device.type == "cpu":
        return (values.unsqueeze(3) * p.unsqueeze(-1)).sum(0)
    return torch.einsum("tbhd,tbhr->bhrd", values, p)


class FunctionalCausalLM(FunctionalForward):
    """Forward passes for a Hugging Face Llama-family ``*ForCausalLM`` module.

    A snapshot of the module's weights at construction: the fused ``qkv`` and ``gate_up`` are
    copies (~70 % of the layers' parameters); the other weights are the module's tensors. Build one
    per use (the rollout engine builds one per ``generate`` call, ~2 ms for W2's model): a weight
    changed afterwards (an optimizer step, ``load_state_dict``, parameters rebound to other
    storage) would reach only the tensors that are not copies. Why not track changes instead:
    version counters do not see every change (a parameter rebound with ``.data`` to a view of a
    buffer that is rewritten later keeps its counter), and a stale copy would sample from a mix of
    two policies.
    """

    def __init__(self, model: nn.Module) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise UnsupportedModelError(f"functional forward cannot run this model: {reason}")
        self.module = model
        config = model.config
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads or self.n_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        self.hidden = config.hidden_size
        self.eps = config.rms_norm_eps
        self.n_layers = len(model.model.layers)
        self._rotary = model.model.rotary_emb
        with torch.no_grad():
            self._layers = [self._fuse(layer) for layer in model.model.layers]

    def _layer_weights(self) -> list[LayerWeights]:
        return self._layers

    @staticmethod
    def _fuse(layer: nn.Module) -> LayerWeights:
        attn, mlp = layer.self_attn, layer.mlp

        def stack(*linears: nn.Linear, bias: bool) -> Tensor | None:
            if not bias:
                return torch.cat([lin.weight for lin in linears])
            if all(lin.bias is None for lin in linears):
                return None
            # a projection without a bias beside others with one adds zeros
            return torch.cat([lin.weight.new_zeros(lin.out_features) if lin.bias is None else lin.bias
                              for lin in linears])

        qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
        gate_up = (mlp.gate_proj, mlp.up_proj)
        return LayerWeights(
            input_norm=layer.input_layernorm.weight,
            qkv=stack(*qkv, bias=False),  # type: ignore[arg-type]
            qkv_bias=stack(*qkv, bias=True),
            o_proj=attn.o_proj.weight,
            o_bias=attn.o_proj.bias,
            post_norm=layer.post_attention_layernorm.weight,
            gate_up=stack(*gate_up, bias=False),  # type: ignore[arg-type]
            gate_up_bias=stack(*gate_up, bias=True),
            down=mlp.down_proj.weight,
            down_bias=mlp.down_proj.bias,
        )

    def _rope_frequencies(self) -> tuple[Tensor, float]:
        return self._rotary.inv_freq, float(getattr(self._rotary, "attention_scaling", 1.0))

    def _embed(self, ids: Tensor) -> Tensor:
        embed = self.module.model.embed_tokens
        # padding_idx as nn.Embedding: the pad row gets no gradient, as in the HF forward.
        return F.embedding(ids, embed.weight, padding_idx=embed.padding_idx)

    def logits(self, hidden: Tensor) -> Tensor:
        model = self.module
        h = self._norm(hidden, model.model.norm.weight)
        return F.linear(h, model.lm_head.weight, getattr(model.lm_head, "bias", None))
