"""Tensor-parallel rollout: the T ranks of an inference group sample together over the fused layout.

Each rank holds its slice of the vLLM-style inference layout (``docs/reshard.md`` §2): fused
``qkv_proj`` of its heads, row-parallel ``o_proj`` / ``down_proj``, fused ``gate_up_proj``,
vocab-parallel ``embed_tokens`` / ``lm_head`` padded to a multiple of T, replicated norms. The
forward passes, the KV cache and the sampling loop are the single-process ones
(:class:`~streamrl.models.functional.FunctionalForward`, :class:`~streamrl.models.functional.KVCache`,
:class:`~streamrl.engines.rollout.BatchedRolloutEngine`); this module only binds their building
blocks to the fused weights and adds the collectives, as ``streamrl.reshard.tp_forward`` does
for a cache-less forward:

- embedding: each rank looks up the ids in its vocabulary rows, zeros elsewhere, all-reduce;
- attention: local query heads and local kv heads (the cache holds only those); ``o_proj`` is
  row-parallel, so its partial products are all-reduced (a replicated bias is added once, after);
- MLP: fused ``gate_up``, row-parallel ``down`` + all-reduce;
- logits: all-gather of the vocab-parallel logits, padding columns trimmed.

Sampling: TP rank 0 samples and broadcasts its tokens and their logprobs to the group (one
collective of 2·B float64 per step). The ranks then agree *by construction* on every token, EOS
and compaction decision, which keeps their collectives in lockstep; the alternative (every rank
samples from identically seeded generators) would need bitwise-identical logits on every rank,
which gloo/NCCL reductions do not promise. The broadcast is small next to a decode step's
forward. Consequence: only rank 0's ``seed`` / ``generator`` / global RNG is consumed.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from streamrl.engines.rollout import BatchedRolloutEngine, GenerateArgumentError, Generation, _Decoder
from streamrl.models.functional import (
    FunctionalForward,
    LayerWeights,
    UnsupportedModelError,
    unsupported_config_reason,
)
from streamrl.reshard.spec import ModelShardingSpec
from streamrl.reshard.tp_forward import default_rope_inv_freq, rope_theta


class TensorParallelRolloutError(ValueError):
    """The group, the weights or the ranks' calls do not fit together; the message names the problem."""


@lru_cache(maxsize=16)
def _inference_shapes(spec: ModelShardingSpec, tensor_parallel: int) -> dict[str, tuple[int, ...]]:
    # cached: the plan lists every rank's pieces, too much work to redo on each generate call
    return spec.inference_plan(tensor_parallel).shapes


def check_inference_weights(
    weights: Mapping[str, Tensor], spec: ModelShardingSpec, tensor_parallel: int, device: torch.device
) -> torch.dtype:
    """Refuse weights that are not one rank's slice of ``spec`` at this T; returns their dtype."""
    expected = _inference_shapes(spec, tensor_parallel)
    where = f"the fused inference layout of this {spec.model_type} model at T={tensor_parallel}"
    missing = [n for n in expected if n not in weights]
    if missing:
        raise TensorParallelRolloutError(
            f"weights lack {len(missing)} name(s) of {where}, e.g. {missing[:3]} (pass one rank's slice as "
            "built by the reshard, e.g. InferenceWeights.use(...), not Hugging Face names)"
        )
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        raise TensorParallelRolloutError(f"weights have name(s) outside {where}: {unexpected[:3]}")
    wrong = [(n, tuple(weights[n].shape), s) for n, s in expected.items() if tuple(weights[n].shape) != s]
    if wrong:
        name, got, want = wrong[0]
        raise TensorParallelRolloutError(
            f"{len(wrong)} weight(s) do not have the shapes of {where}: {name} is {got}, expected {want} "
            "(resharded for another T, or a full tensor?)"
        )
    dtype = weights["model.embed_tokens.weight"].dtype
    odd = [n for n, w in weights.items() if w.dtype != dtype or w.device != device]
    if odd:
        w = weights[odd[0]]
        raise TensorParallelRolloutError(
            f"every weight must be {dtype} on {device} (the engine's device); {odd[0]} is {w.dtype} on {w.device}"
        )
    return dtype


class TensorParallelFunctionalLM(FunctionalForward):
    """One inference rank's forward over its fused weights; every rank of ``group`` runs the same calls.

    ``n_heads`` / ``n_kv_heads`` are this rank's (``nh/T``, ``max(1, nkv/T)``), so the inherited
    packed, shared-prompt and cached-decoding passes run unchanged on the local heads. ``logits``
    returns the full (unpadded) vocabulary on every rank. Inference only: the collectives are
    not differentiable. ``group=None`` is T = 1 (no collectives).
    """

    def __init__(
        self,
        weights: Mapping[str, Tensor],
        spec: ModelShardingSpec,
        *,
        rms_norm_eps: float,
        rope_base: float,
        group: dist.ProcessGroup | None,
        device: torch.device | None = None,
    ) -> None:
        T = 1 if group is None else dist.get_world_size(group)
        t = 0 if group is None else dist.get_rank(group)
        device = weights["model.embed_tokens.weight"].device if device is None else device
        self.dtype = check_inference_weights(weights, spec, T, device)
        self.group, self.tensor_parallel, self.rank = group, T, t
        self.n_heads = spec.num_heads // T
        self.n_kv_heads = max(1, spec.num_kv_heads // T)  # T > nkv: this rank's one (replicated) kv head
        self.head_dim = spec.head_dim
        self.hidden = spec.hidden_size
        self.eps = rms_norm_eps
        self.n_layers = spec.num_layers
        self.vocab_size = spec.vocab_size
        self._inv_freq = default_rope_inv_freq(rope_base, spec.head_dim, device)
        self._vocab_rows = spec.padded_vocab(T) // T
        self._vocab_start = t * self._vocab_rows
        self._embed_weight = weights["model.embed_tokens.weight"]
        self._final_norm = weights["model.norm.weight"]
        self._lm_head = weights["lm_head.weight"]
        # Resolved once per call: the decode loop then indexes a list instead of formatting names.
        self._layers = [
            LayerWeights(
                input_norm=weights[f"model.layers.{i}.input_layernorm.weight"],
                qkv=weights[f"model.layers.{i}.self_attn.qkv_proj.weight"],
                qkv_bias=weights.get(f"model.layers.{i}.self_attn.qkv_proj.bias"),
                o_proj=weights[f"model.layers.{i}.self_attn.o_proj.weight"],
                o_bias=weights.get(f"model.layers.{i}.self_attn.o_proj.bias"),
                post_norm=weights[f"model.layers.{i}.post_attention_layernorm.weight"],
                gate_up=weights[f"model.layers.{i}.mlp.gate_up_proj.weight"],
                gate_up_bias=None,  # the inference layout has no MLP biases (docs/reshard.md §2)
                down=weights[f"model.layers.{i}.mlp.down_proj.weight"],
                down_bias=None,
            )
            for i in range(spec.num_layers)
        ]

    def _all_reduce(self, x: Tensor) -> Tensor:
        if self.group is not None:
            dist.all_reduce(x, group=self.group)
        return x

    def _rope_frequencies(self) -> tuple[Tensor, float]:
        return self._inv_freq, 1.0

    def _embed(self, ids: Tensor) -> Tensor:
        # Vocab-parallel lookup: ids outside this rank's rows read a clamped row that is then
        # zeroed, so the all-reduce sums exactly one real row per token.
        local = ids - self._vocab_start
        owned = (local >= 0) & (local < self._vocab_rows)
        rows = F.embedding(local.clamp(0, self._vocab_rows - 1), self._embed_weight)
        return self._all_reduce(rows.masked_fill_(~owned.unsqueeze(-1), 0.0))

    def _layer_weights(self) -> list[LayerWeights]:
        return self._layers

    def logits(self, hidden: Tensor) -> Tensor:
        local = F.linear(self._norm(hidden, self._final_norm), self._lm_head)
        if self.group is not None:
            parts = [torch.empty_like(local) for _ in range(self.tensor_parallel)]
            dist.all_gather(parts, local, group=self.group)
            local = torch.cat(parts, dim=-1)
        return local[..., : self.vocab_size]  # the padding rows of the vocabulary are not tokens


class TensorParallelRolloutEngine(BatchedRolloutEngine):
    """Sample completions with the T ranks of an inference group, each holding its fused slice.

    Same ``generate`` semantics as :class:`~streamrl.engines.rollout.TorchRolloutEngine` (shared
    prompt prefill, per-row KV cache, EOS stop, compaction, unfiltered logprobs), plus the
    ``weights`` of this call. Every rank of ``group`` calls ``generate`` with the same prompts and
    arguments (checked: one small all-reduce per call) and gets the same generations.

    ``weights`` is this rank's slice (names and shapes of ``spec.inference_plan(T).shapes``, e.g.
    the dict an ``InferenceWeights.use(version)`` lease yields); the engine keeps no reference to
    it once ``generate`` returns, so the lease may be released then. ``group=None`` runs T = 1 in
    this process.
    """

    def __init__(
        self,
        config: Any,
        eos_token_id: int,
        pad_token_id: int,
        *,
        group: dist.ProcessGroup | None,
        tensor_parallel: int | None = None,
        device: str | torch.device = "cpu",
        compact_below: float = 0.75,
    ) -> None:
        """``config``: the model's transformers config. ``tensor_parallel``: the expected T (checked
        against the group size when given). ``device``: where the weights and the KV cache live."""
        super().__init__(eos_token_id, pad_token_id, torch.device(device), compact_below)
        reason = unsupported_config_reason(config)
        if reason is not None:
            raise UnsupportedModelError(f"TensorParallelRolloutEngine cannot run this model: {reason}")
        try:
            self._rope_base = rope_theta(config)
        except ValueError as exc:
            raise UnsupportedModelError(f"TensorParallelRolloutEngine cannot run this model: {exc}") from None
        self.spec = ModelShardingSpec.from_config(config)
        self.group = group
        group_size = 1 if group is None else dist.get_world_size(group)
        if tensor_parallel is not None and tensor_parallel != group_size:
            raise TensorParallelRolloutError(
                f"tensor_parallel={tensor_parallel} but the inference group has {group_size} rank(s)"
                + (" (group=None is T = 1)" if group is None else "")
                + "; pass the group of this rank's T inference ranks"
            )
        self.tensor_parallel = group_size
        self.rank = 0 if group is None else dist.get_rank(group)
        self.spec.check_inference_tp(group_size)  # LayoutError names the head/MLP count T must divide
        self._rms_norm_eps = float(config.rms_norm_eps)
        self._weights: Mapping[str, Tensor] | None = None  # set for the duration of one generate call

    def functional(self, weights: Mapping[str, Tensor]) -> TensorParallelFunctionalLM:
        """The TP forward of this rank over ``weights`` (checked), e.g. for prefill logits."""
        return TensorParallelFunctionalLM(
            weights, self.spec, rms_norm_eps=self._rms_norm_eps, rope_base=self._rope_base,
            group=self.group, device=self.device,
        )

    def generate(self, prompts: list[Tensor], *, weights: Mapping[str, Tensor], **options: Any) -> list[Generation]:
        """One completion per prompt, sampled with this rank's ``weights`` (see the class docstring).

        ``options``: the keywords of ``TorchRolloutEngine.generate`` (``max_new_tokens``,
        ``temperature``, ``top_p``, ``top_k``, ``seed``, ``generator``, ``streams``), passed through so
        the two engines cannot drift apart; only rank 0's ``seed`` / ``generator`` / ``streams`` are used.
        """
        self._weights = weights
        try:
            return super().generate(prompts, **options)
        finally:
            self._weights = None  # the weights may be released once we return

    def _check(self, prompts: list[Tensor], max_new_tokens: int, temperature: float, top_p: float, top_k: int) -> None:
        """The arguments and this rank's weights, then the group's agreement (every rank raises alike)."""
        problem: ValueError | None = None
        try:
            super()._check(prompts, max_new_tokens, temperature, top_p, top_k)
            if self._weights is None:
                raise TensorParallelRolloutError("TensorParallelRolloutEngine decodes only inside generate(weights=...)")
            check_inference_weights(self._weights, self.spec, self.tensor_parallel, self.device)
        except ValueError as exc:  # GenerateArgumentError, TensorParallelRolloutError
            problem = exc
        self._agree(problem, prompts, (max_new_tokens, temperature, top_p, top_k))

    def _agree(self, problem: ValueError | None, prompts: list[Tensor], args: tuple[Any, ...]) -> None:
        """Raise on every rank if any rank refused its arguments or weights, or the ranks' calls differ.

        Why: a rank that raised alone would leave the others blocked in the next collective until
        the group's timeout; ranks with different prompts would compute garbage or hang.
        """
        if self.group is None:
            if problem is not None:
                raise problem
            return
        digest = 0
        if problem is None:  # a checksum of what must be equal on every rank
            digest = zlib.crc32(repr(args).encode())
            for p in prompts:
                digest = zlib.crc32(p.cpu().numpy().tobytes(), zlib.crc32(str(p.numel()).encode(), digest))
        # MAX of (failed, digest, -digest): any failure shows, and the digests agree iff max == min.
        flags = torch.tensor([problem is not None, digest, -digest], dtype=torch.int64)
        if dist.get_backend(self.group) == dist.Backend.NCCL:
            flags = flags.to(self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        failed, high, neg_low = (int(v) for v in flags.tolist())
        if problem is not None:
            raise problem
        if failed:
            raise TensorParallelRolloutError(
                "another rank of the inference group refused its generate arguments or weights (see its error)"
            )
        if high != -neg_low:
            raise GenerateArgumentError(
                "the ranks of the inference group called generate with different prompts or max_new_tokens/"
                "temperature/top_p/top_k; every rank must pass the same ones"
            )

    def _decoder(self) -> _Decoder:
        assert self._weights is not None  # _check refused a call without weights
        fn = self.functional(self._weights)
        return self._functional_decoder(fn, fn.dtype, self.device)

    def _sample(
        self, logits: Tensor, *, temperature: float, top_k: int, top_p: float, generator: torch.Generator | None,
        uniforms: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        if self.group is None:
            return super()._sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator,
                                   uniforms=uniforms)
        # float64 carries int64 token ids (< 2^53) and float32 logprobs exactly: one collective.
        packed = torch.empty((2, logits.shape[0]), dtype=torch.float64, device=logits.device)
        if self.rank == 0:
            tokens, logprobs = super()._sample(
                logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator, uniforms=uniforms
            )
            packed[0], packed[1] = tokens, logprobs
        dist.broadcast(packed, group=self.group, group_src=0)
        return packed[0].to(torch.int64), packed[1].to(torch.float32)
