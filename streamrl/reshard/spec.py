"""What to cut: a model's parameters, how training splits them, and the fused inference targets.

The training side keeps the Hugging Face names and shapes (``q_proj``, ``k_proj``, ``v_proj``,
``gate_proj``, ``up_proj`` separate). The inference side uses the vLLM layout, where each
tensor-parallel rank t of T holds *fused* weights:

- ``qkv_proj``  = [q rows of t's heads; k rows of t's kv heads; v rows of t's kv heads]
  (weight and, for Qwen2, bias). With T > num_kv_heads each kv head is replicated on
  T // num_kv_heads consecutive ranks, as vLLM does.
- ``gate_up_proj`` = [gate rows t; up rows t].
- ``o_proj`` / ``down_proj``: row-parallel, columns block t.
- ``embed_tokens`` / ``lm_head``: vocab-parallel, rows block t of the vocab padded up to a
  multiple of T (padding rows are zero).
- norms: replicated.

A :class:`Piece` says "copy this rectangle of the full training tensor to this origin in this
rank's target tensor"; an :class:`InferencePlan` lists the pieces of every inference rank. The
reshard never builds a full tensor: it copies each piece straight out of the gathered shards.

Any other architecture (GPT-2, ...) gets a *generic* spec from :meth:`ModelShardingSpec.from_model`,
built from the module's parameter names and shapes alone: every parameter replicated over train
TP (so only train tensor_parallel 1), data-parallel sharding along dim 0 as usual, and an
inference plan for T = 1 only, in which each inference weight is the Hugging Face parameter
itself. Without knowing which dims hold heads, nothing can be split safely.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from math import prod
from typing import Any

import torch
from torch import nn

from streamrl.reshard.layout import LayoutError, TrainLayout

#: Per-dimension half-open ranges ``((start0, stop0), (start1, stop1), ...)`` in full-tensor coordinates.
Rect = tuple[tuple[int, int], ...]

# The model types whose layout streamrl knows ("supported"): the Llama-family decoders (pre-norm
# RMSNorm, RoPE, grouped-query attention, SwiGLU MLP) under the Hugging Face parameter names
# (self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj). Two paths need it:
# - the sharding spec (ModelShardingSpec.from_config, below): head-aware splits for train
#   tensor_parallel > 1 and inference tensor_parallel T > 1; other models get a generic spec
#   (whole parameters: train tensor_parallel 1 and T = 1 only);
# - the functional forward (streamrl.models.functional) of the built-in rollout engines, single
#   process and tensor-parallel, given its further config checks (no sliding window, static RoPE);
#   other models use the Hugging Face forward and cannot use the tensor-parallel rollout engine.
SUPPORTED_MODEL_TYPES = ("qwen2", "llama", "mistral")


def full_rect(shape: tuple[int, ...]) -> Rect:
    return tuple((0, n) for n in shape)


def with_range(shape: tuple[int, ...], dim: int, start: int, stop: int) -> Rect:
    """The rectangle covering ``shape`` except along ``dim``, where it covers [start, stop)."""
    rect = list(full_rect(shape))
    rect[dim] = (start, stop)
    return tuple(rect)


def intersect(a: Rect, b: Rect) -> Rect | None:
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    return None if any(lo >= hi for lo, hi in out) else out


def rect_shape(rect: Rect) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in rect)


@dataclass(frozen=True)
class ParamSpec:
    """One training parameter.

    train_tp_dim: 0 = column-parallel (output features split over the P TP ranks; for the
        embeddings and lm_head: vocab-parallel), 1 = row-parallel (input features split),
        None = replicated over the TP ranks (norms, a Llama o_proj bias).
    """

    name: str
    shape: tuple[int, ...]
    train_tp_dim: int | None

    @property
    def numel(self) -> int:
        return prod(self.shape)


@dataclass(frozen=True)
class Piece:
    """Copy ``source_rect`` of the full training tensor ``source`` to ``target_origin`` of ``target``."""

    source: str
    target: str
    source_rect: Rect
    target_origin: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return rect_shape(self.source_rect)

    @property
    def numel(self) -> int:
        return prod(self.shape)

    def target_rect(self) -> Rect:
        return tuple((o, o + n) for o, n in zip(self.target_origin, self.shape, strict=True))


@dataclass(frozen=True)
class InferencePlan:
    """The inference layout for a given T: per-rank target shapes and every rank's pieces.

    ``shapes`` is the same for every rank (vLLM pads where T does not divide a dimension).
    ``pieces[t]`` is in training-parameter order, so a bucket of training parameters maps to a
    contiguous run of pieces.
    """

    tensor_parallel: int
    shapes: dict[str, tuple[int, ...]]
    pieces: tuple[tuple[Piece, ...], ...]

    def numel(self) -> int:
        return sum(prod(s) for s in self.shapes.values())


@dataclass(frozen=True)
class ModelShardingSpec:
    """A Llama-style decoder (Qwen2, Llama) seen as shardable parameters.

    Build it with :meth:`from_config` from a transformers config, or with :meth:`from_model` from
    a module (the same spec for Qwen2/Llama; a generic one for any other architecture). Field
    units: counts of heads, features and tokens.

    llama_family: False for a generic spec (see the module docstring); its size fields are what
        the config says (0 where it says nothing) and only describe the model: no split uses them.
    """

    model_type: str
    params: tuple[ParamSpec, ...]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attention_bias: bool
    tied_embeddings: bool
    llama_family: bool = True

    @classmethod
    def from_model(cls, model: nn.Module) -> ModelShardingSpec:
        """The spec of ``model``'s parameters, as ``model.named_parameters()`` lists them.

        Qwen2/Llama: :meth:`from_config` of its config, checked against the module's parameters.
        Any other model_type: a generic spec (every parameter whole; T = 1, train TP 1). A tied
        lm_head is the embedding's Parameter, listed once by ``named_parameters``, so it is not a
        parameter of its own here either: the spec lists exactly what the trainer optimises.
        """
        config = getattr(model, "config", None)
        model_type = getattr(config, "model_type", None)
        shapes = [(name, tuple(param.shape)) for name, param in model.named_parameters()]
        if model_type in SUPPORTED_MODEL_TYPES:
            spec = cls.from_config(config)
            expected = {p.name: p.shape for p in spec.params}
            if dict(shapes) != expected:
                actual = dict(shapes)
                extra = sorted(set(actual) - set(expected))
                missing = sorted(set(expected) - set(actual))
                reshaped = sorted(n for n in set(actual) & set(expected) if actual[n] != expected[n])
                raise LayoutError(
                    f"the module's parameters do not match the {model_type} sharding spec of its config: "
                    f"unexpected {extra[:3]}, missing {missing[:3]}, other shapes {reshaped[:3]}"
                )
            return spec
        return cls.from_named_shapes(
            str(model_type or type(model).__name__), shapes, config=config, tied=_tied_embeddings(model)
        )

    @classmethod
    def from_named_shapes(
        cls,
        model_type: str,
        shapes: Iterable[tuple[str, tuple[int, ...]]],
        *,
        config: Any = None,
        tied: bool = False,
    ) -> ModelShardingSpec:
        """A generic spec over ``(name, shape)`` pairs, in their order (``named_parameters`` order).

        ``config`` (optional) only fills the descriptive size fields; ``tied`` says the output
        embedding is the input embedding (recorded, changes nothing: each listed tensor is whole).
        """
        params = tuple(ParamSpec(name, tuple(int(n) for n in shape), None) for name, shape in shapes)
        if not params:
            raise LayoutError(f"the {model_type} model has no parameters to shard")
        names = [p.name for p in params]
        if len(set(names)) != len(names):
            duplicated = sorted({n for n in names if names.count(n) > 1})
            raise LayoutError(f"parameter names must be unique, got {duplicated[:3]} more than once")
        scalars = [p.name for p in params if not p.shape]
        if scalars:
            # Training shards every parameter along dim 0; a 0-d tensor has none to cut.
            raise LayoutError(
                f"the {model_type} model has 0-d (scalar) parameters {scalars[:3]}; the reshard shards "
                "along dim 0 and cannot hold them"
            )

        def size(*keys: str) -> int:
            for key in keys:
                value = getattr(config, key, None)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
            return 0

        heads = size("num_attention_heads")
        hidden = size("hidden_size")
        return cls(
            model_type=model_type,
            params=params,
            vocab_size=size("vocab_size"),
            hidden_size=hidden,
            intermediate_size=size("intermediate_size", "n_inner"),
            num_layers=size("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=size("num_key_value_heads") or heads,
            head_dim=size("head_dim") or (hidden // heads if heads else 0),
            attention_bias=False,
            tied_embeddings=tied,
            llama_family=False,
        )

    @classmethod
    def from_config(cls, config: Any) -> ModelShardingSpec:
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise LayoutError(
                f"model_type {model_type!r} has no sharding spec; supported: {SUPPORTED_MODEL_TYPES}. "
                "Add its parameter names and split dims to streamrl/reshard/spec.py."
            )
        if model_type == "llama" and getattr(config, "mlp_bias", False):
            raise LayoutError("llama with mlp_bias=True is not supported by the reshard spec")
        H = int(config.hidden_size)
        nh = int(config.num_attention_heads)
        nkv = int(getattr(config, "num_key_value_heads", None) or nh)
        d = int(getattr(config, "head_dim", None) or H // nh)
        bias = True if model_type == "qwen2" else bool(getattr(config, "attention_bias", False))
        V, Im, L = int(config.vocab_size), int(config.intermediate_size), int(config.num_hidden_layers)
        tied = bool(getattr(config, "tie_word_embeddings", False))

        # embeddings are vocab-parallel in training TP (Megatron): rows split, lookups masked
        params: list[ParamSpec] = [ParamSpec("model.embed_tokens.weight", (V, H), 0)]
        for i in range(L):
            p = f"model.layers.{i}."
            params.append(ParamSpec(p + "input_layernorm.weight", (H,), None))
            for proj, rows in (("q_proj", nh * d), ("k_proj", nkv * d), ("v_proj", nkv * d)):
                params.append(ParamSpec(f"{p}self_attn.{proj}.weight", (rows, H), 0))
                if bias:
                    params.append(ParamSpec(f"{p}self_attn.{proj}.bias", (rows,), 0))
            params.append(ParamSpec(p + "self_attn.o_proj.weight", (H, nh * d), 1))
            if model_type == "llama" and bias:
                params.append(ParamSpec(p + "self_attn.o_proj.bias", (H,), None))
            params.append(ParamSpec(p + "post_attention_layernorm.weight", (H,), None))
            params.append(ParamSpec(p + "mlp.gate_proj.weight", (Im, H), 0))
            params.append(ParamSpec(p + "mlp.up_proj.weight", (Im, H), 0))
            params.append(ParamSpec(p + "mlp.down_proj.weight", (H, Im), 1))
        params.append(ParamSpec("model.norm.weight", (H,), None))
        if not tied:
            params.append(ParamSpec("lm_head.weight", (V, H), 0))
        return cls(model_type, tuple(params), V, H, Im, L, nh, nkv, d, bias, tied)

    # -- lookups --------------------------------------------------------------------------------
    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def param(self, name: str) -> ParamSpec:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(f"no parameter {name!r} in the {self.model_type} sharding spec")

    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    # -- training layout checks -----------------------------------------------------------------
    def check_train_layout(self, layout: TrainLayout) -> None:
        """Refuse a train TP degree that would split a head or leave uneven column chunks."""
        P = layout.tensor_parallel
        if not self.llama_family:
            if P > 1:
                raise LayoutError(
                    f"train tensor_parallel={P} needs a Llama-family model ({', '.join(SUPPORTED_MODEL_TYPES)}): "
                    f"this {self.model_type} model has a generic sharding spec, which cannot tell which dims "
                    "hold heads; use train tensor_parallel 1 (data-parallel sharding works for any model)"
                )
            return
        problems = [
            f"num_attention_heads={self.num_heads}" if self.num_heads % P else "",
            f"num_key_value_heads={self.num_kv_heads}" if self.num_kv_heads % P else "",
            f"intermediate_size={self.intermediate_size}" if self.intermediate_size % P else "",
            # only where training splits the vocab (Megatron style): FSDP2 x TP keeps it whole
            f"vocab_size={self.vocab_size}" if self.vocab_size % P and self._vocab_split() else "",
        ]
        problems = [p for p in problems if p]
        if problems:
            raise LayoutError(
                f"train tensor_parallel={P} must divide {', '.join(problems)} (training TP splits whole "
                "heads, equal MLP chunks and equal vocab chunks); pick a train tensor_parallel that divides them"
            )

    def _vocab_split(self) -> bool:
        return any(p.train_tp_dim is not None for p in self.params
                   if p.name in ("model.embed_tokens.weight", "lm_head.weight"))

    # -- inference layout -----------------------------------------------------------------------
    def check_inference_tp(self, T: int) -> None:
        if not self.llama_family:
            if T != 1:
                raise LayoutError(
                    f"inference tensor_parallel T={T} needs a Llama-family model "
                    f"({', '.join(SUPPORTED_MODEL_TYPES)}): this {self.model_type} model has a generic "
                    "sharding spec, whose inference weights are the whole Hugging Face parameters; use T=1"
                )
            return
        problems = []
        if self.num_heads % T:
            problems.append(f"num_attention_heads={self.num_heads} (must be divisible by T)")
        if self.num_kv_heads % T and T % self.num_kv_heads:
            problems.append(
                f"num_key_value_heads={self.num_kv_heads} (T must divide it, or it must divide T so kv "
                "heads are replicated)"
            )
        if self.intermediate_size % T:
            problems.append(f"intermediate_size={self.intermediate_size} (must be divisible by T)")
        if problems:
            raise LayoutError(
                f"inference tensor_parallel T={T} does not fit this {self.model_type} model: "
                + "; ".join(problems)
            )

    def padded_vocab(self, T: int) -> int:
        return -(-self.vocab_size // T) * T

    def inference_plan(self, T: int) -> InferencePlan:
        self.check_inference_tp(T)
        return InferencePlan(T, self._inference_shapes(T), tuple(tuple(self._pieces(T, t)) for t in range(T)))

    def _heads_per_rank(self, T: int) -> tuple[int, int]:
        """(q heads, kv heads) on one inference rank."""
        return self.num_heads // T, max(1, self.num_kv_heads // T)

    def _kv_head_start(self, T: int, t: int) -> int:
        if self.num_kv_heads >= T:
            return t * (self.num_kv_heads // T)
        return t // (T // self.num_kv_heads)  # replicated kv heads

    def _inference_shapes(self, T: int) -> dict[str, tuple[int, ...]]:
        if not self.llama_family:  # T = 1 (checked): each inference weight is the parameter itself
            return {p.name: p.shape for p in self.params}
        H, d = self.hidden_size, self.head_dim
        qh, kh = self._heads_per_rank(T)
        vocab_rows = self.padded_vocab(T) // T
        It = self.intermediate_size // T
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab_rows, H)}
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (H,)
            shapes[p + "self_attn.qkv_proj.weight"] = ((qh + 2 * kh) * d, H)
            if self.attention_bias:
                shapes[p + "self_attn.qkv_proj.bias"] = ((qh + 2 * kh) * d,)
            shapes[p + "self_attn.o_proj.weight"] = (H, qh * d)
            if self.model_type == "llama" and self.attention_bias:
                shapes[p + "self_attn.o_proj.bias"] = (H,)
            shapes[p + "post_attention_layernorm.weight"] = (H,)
            shapes[p + "mlp.gate_up_proj.weight"] = (2 * It, H)
            shapes[p + "mlp.down_proj.weight"] = (H, It)
        shapes["model.norm.weight"] = (H,)
        shapes["lm_head.weight"] = (vocab_rows, H)
        return shapes

    def _pieces(self, T: int, t: int) -> Iterator[Piece]:
        """Pieces of inference rank t, in training-parameter order."""
        if not self.llama_family:  # identity: the whole parameter, to the same name
            for p in self.params:
                yield Piece(p.name, p.name, full_rect(p.shape), (0,) * len(p.shape))
            return
        d = self.head_dim
        qh, kh = self._heads_per_rank(T)
        kv0 = self._kv_head_start(T, t)
        It = self.intermediate_size // T
        vocab_rows = self.padded_vocab(T) // T
        v0, v1 = t * vocab_rows, min((t + 1) * vocab_rows, self.vocab_size)
        # (source rows range, target row offset) of each fused part, by training projection name
        fused_rows = {
            "q_proj": ((t * qh * d, (t + 1) * qh * d), 0),
            "k_proj": ((kv0 * d, (kv0 + kh) * d), qh * d),
            "v_proj": ((kv0 * d, (kv0 + kh) * d), (qh + kh) * d),
            "gate_proj": ((t * It, (t + 1) * It), 0),
            "up_proj": ((t * It, (t + 1) * It), It),
        }
        for p in self.params:
            name, shape = p.name, p.shape
            if name == "model.embed_tokens.weight":
                if v0 < v1:  # padding-only ranks (tiny vocab, large T) get no rows
                    yield Piece(name, name, with_range(shape, 0, v0, v1), (0, 0))
                    if self.tied_embeddings:
                        yield Piece(name, "lm_head.weight", with_range(shape, 0, v0, v1), (0, 0))
            elif name == "lm_head.weight":
                if v0 < v1:
                    yield Piece(name, name, with_range(shape, 0, v0, v1), (0, 0))
            elif name.endswith(("o_proj.weight", "down_proj.weight")):  # row-parallel: a column block
                cols = shape[1] // T
                yield Piece(name, name, with_range(shape, 1, t * cols, (t + 1) * cols), (0, 0))
            elif name.rsplit(".", 2)[1] in fused_rows:  # q/k/v/gate/up weight or bias: a row block
                # of a fused target. By name, not by train_tp_dim: the inference layout does not depend
                # on how training splits (spec_for_placements rewrites train_tp_dim from FSDP2's placements)
                module, proj, kind = name.rsplit(".", 2)
                (r0, r1), offset = fused_rows[proj]
                fused = "qkv_proj" if proj in ("q_proj", "k_proj", "v_proj") else "gate_up_proj"
                origin = (offset,) + (0,) * (len(shape) - 1)
                yield Piece(name, f"{module}.{fused}.{kind}", with_range(shape, 0, r0, r1), origin)
            else:  # norms and other replicated vectors
                yield Piece(name, name, full_rect(shape), (0,) * len(shape))


def _tied_embeddings(model: nn.Module) -> bool:
    """Whether the output embedding's weight is the input embedding's Parameter (GPT-2's lm_head)."""
    get_inputs = getattr(model, "get_input_embeddings", None)
    get_output = getattr(model, "get_output_embeddings", None)
    if not callable(get_inputs) or not callable(get_output):
        return False
    try:
        inputs, output = get_inputs(), get_output()
    except NotImplementedError:  # transformers' default for a model that does not say
        return False
    weight = getattr(inputs, "weight", None)
    return weight is not None and getattr(output, "weight", None) is weight


def local_hf_views(
    tensors: Mapping[str, torch.Tensor], plan: InferencePlan, inference_rank: int
) -> dict[str, torch.Tensor]:
    """This rank's fused inference weights seen under the Hugging Face names, as zero-copy views.

    With T = 1 the result is exactly the model's state dict (``q_proj.weight`` is a row view of
    ``qkv_proj.weight``, padding rows excluded), ready for an engine that loads HF weights; with
    T > 1 each view is this rank's TP-local part (its heads, its MLP columns, its vocab rows).
    A tied ``lm_head`` is not listed separately (it is the embedding).
    """
    views: dict[str, torch.Tensor] = {}
    for piece in plan.pieces[inference_rank]:
        if piece.source == "model.embed_tokens.weight" and piece.target == "lm_head.weight":
            continue  # tied: the HF state dict has the embedding only
        region = tuple(slice(lo, hi) for lo, hi in piece.target_rect())
        views[piece.source] = tensors[piece.target][region]
    return views
