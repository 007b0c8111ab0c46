"""The tiny model's shape as the run config states it: a plain struct, importable without torch or
transformers (the launcher validates configs before it needs either)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta


class TinyModelSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Shape of a tiny decoder-only model built from a config (random init).

    Defaults are the baseline's workload W1 model (about 0.4 M parameters).
    """

    arch: Annotated[Literal["qwen2", "llama", "gpt2"], Meta(description=(
        "qwen2 = the baseline (q/k/v biases); llama = no biases; gpt2 = learned positions, GELU MLP, tied "
        "embeddings (outside the Llama family: the engines run it through the HF forward)"))] = "qwen2"
    hidden: Annotated[int, Meta(description="Model width (channels); a multiple of heads")] = 128
    layers: Annotated[int, Meta(description="Decoder blocks")] = 2
    heads: Annotated[int, Meta(description="Attention heads; head_dim = hidden / heads")] = 4
    kv_heads: Annotated[int | None, Meta(description=(
        "Key/value heads for grouped-query attention (must divide heads); null = heads (plain MHA)"))] = None
    intermediate: Annotated[int, Meta(description=(
        "MLP width (channels): SwiGLU for qwen2/llama, GELU for gpt2"))] = 256
    max_positions: Annotated[int, Meta(description=(
        "Positions the config advertises (tokens); prompt + completion must fit. qwen2/llama: RoPE; gpt2: the "
        "size of its learned position table, so a position past it cannot be run at all"))] = 64
    tie_embeddings: Annotated[bool | None, Meta(description=(
        "Share the input embedding and lm_head; null = the architecture's own choice: untied for qwen2/llama "
        "(as the baseline), tied for gpt2 (which cannot untie)"))] = None
    seed: Annotated[int, Meta(description=(
        "torch seed of the random init (same seed = same weights as the baseline)"))] = 0

    def __post_init__(self) -> None:
        for name in ("hidden", "layers", "heads", "intermediate", "max_positions"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"TinyModelSpec.{name} must be >= 1, got {value}")
        if self.hidden % self.heads:
            raise ValueError(
                f"TinyModelSpec.hidden ({self.hidden}) must be a multiple of heads ({self.heads})"
            )
        if self.kv_heads is not None and (self.kv_heads < 1 or self.heads % self.kv_heads):
            raise ValueError(
                f"TinyModelSpec.kv_heads ({self.kv_heads}) must divide heads ({self.heads}); "
                "use None for plain multi-head attention"
            )
        if self.arch == "gpt2":
            if self.kv_heads is not None:
                raise ValueError(
                    f"TinyModelSpec.kv_heads must be left unset (null) for arch gpt2, got {self.kv_heads}: GPT-2 has "
                    "plain multi-head attention, one key/value head per query head"
                )
            if self.tie_embeddings is False:
                raise ValueError(
                    "TinyModelSpec.tie_embeddings=false is not possible for arch gpt2: GPT-2's lm_head is "
                    "always its input embedding; leave tie_embeddings out (or true)"
                )
        if self.tie_embeddings is None:
            # Resolved here so every reader (run config dump, pipeline checks) sees a plain bool.
            msgspec.structs.force_setattr(self, "tie_embeddings", self.arch == "gpt2")

    @property
    def tied(self) -> bool:
        """``tie_embeddings`` as a bool (always resolved by construction)."""
        return bool(self.tie_embeddings)
