"""Built-in torch rollout engine: batched sampling with a KV cache, on CPU, CUDA or NPU.

Why not ``model.generate()``: for tiny models its per-step Python overhead (logits processors,
stopping criteria, cache objects, mask building) costs more than the maths. This engine runs a
plain loop over the functional forward (``streamrl.models.functional``) with a preallocated
KV cache, and for architectures the functional forward does not cover (GPT-2, ...), over the
Hugging Face forward with a ``DynamicCache`` (same results, slower). Which one runs is logged
once per engine on ``streamrl.engine.rollout`` and kept in ``TorchRolloutEngine.forward_path``.

What it does per call:
- identical prompts are prefilled once and their cache rows copied (GRPO asks for n
  completions of each prompt, so the prefill shrinks n-fold);
- ragged prompts are right-padded; every sequence keeps its own positions 0..n-1 (RoPE angles,
  or rows of a learned position table such as GPT-2's), the same positions the train engine
  uses, so the logprobs returned here equal the train engine's recomputation up to float
  rounding;
- a sequence leaves the batch when it emits EOS or reaches ``max_new_tokens``; finished rows are
  dropped from the cache once they are a quarter of the batch (copying the cache every step
  costs more than computing a few dead rows);
- ``streams`` gives each prompt a random stream of its own (a seed and the index of its first
  draw): its k-th token is drawn with :func:`stream_uniforms` at that index + k, so its tokens
  do not depend on the other prompts of the call, nor on how a completion is split into calls.
  Without them the call's rows draw from one ``generator``.
"""

from __future__ import annotations

import hashlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from streamrl.engines.core_share import DECODE_GRAIN, rebalance, work
from streamrl.models.device import resolve_device
from streamrl.models.functional import FunctionalCausalLM, FunctionalForward, KVCache, unsupported_reason
from streamrl.models.matmul_precision import attention_dtype

FinishReason = Literal["eos", "length"]
RolloutForwardPath = Literal["functional", "hf"]

log = logging.getLogger("streamrl.engine.rollout")
# tensor types the foreach install copies into and from; others (DTensor) take load_state_dict
_PLAIN = (torch.Tensor, nn.Parameter)


class GenerateArgumentError(ValueError):
    """A ``generate`` argument is out of range; the message names it."""


@dataclass(frozen=True, slots=True)
class Generation:
    """One completion. Tensors are on CPU."""

    response_ids: Tensor  # [n] int64 sampled tokens, EOS included when emitted
    logprobs: Tensor  # [n] float32 log p(token) under log_softmax(logits / temperature), unfiltered
    finish_reason: FinishReason  # "eos": emitted EOS; "length": hit max_new_tokens


# splitmix64's constants, as the signed int64 values of their bits (torch has no uint64 arithmetic)
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64


def _shift_right(x: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` on int64 keeps the sign)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def stream_uniforms(seeds: Tensor, counters: Tensor) -> Tensor:
    """A uniform draw in (0, 1) (float64) for each (seed, counter) pair of the int64 tensors.

    The draw is a function of the pair alone: splitmix64 (Steele, Lea and Flood, 2014) of the seed
    stepped ``counter + 1`` times, its top 53 bits as the fraction. So a stream's k-th draw is the
    same whichever call, batch or row makes it. int64 multiplication wraps, as the uint64 one does."""
    z = seeds + (counters + 1) * _GOLDEN
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    z = z ^ _shift_right(z, 31)
    return (_shift_right(z, 11).to(torch.float64) + 0.5) * 2.0**-53


def stream_seed(*parts: int | str) -> int:
    """A stream's seed from what names it (a run's seed, a session, a turn, a choice): the same
    parts give the same seed in every process (unlike ``hash`` of a string). A non-negative int63."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def check_streams(streams: Sequence[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """``streams`` of a ``generate`` call for ``n`` prompts, checked: one (seed, first draw) pair of
    int64s per prompt, the first draw >= 0 (every engine's ``streams`` argument)."""
    if len(streams) != n:
        raise GenerateArgumentError(f"streams has {len(streams)} entries for {n} prompts: give each prompt one")
    for i, pair in enumerate(streams):
        if (not isinstance(pair, tuple | list) or len(pair) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) and -2**63 <= v < 2**63 for v in pair)
                or pair[1] < 0):
            raise GenerateArgumentError(f"streams[{i}] must be a (seed, first draw) pair of int64s, the first draw "
                                        f">= 0, got {pair!r}")
    return [(pair[0], pair[1]) for pair in streams]


def sample_tokens(
    logits: Tensor, *, temperature: float, top_k: int = 0, top_p: float = 1.0, generator: torch.Generator | None = None,
    uniforms: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Sample one token per row of ``logits`` [B, V]; returns (tokens [B] int64, logprobs [B] float32).

    The logprob is taken from the *unfiltered* tempered distribution: top-k / top-p only
    restrict which tokens may be drawn. That is the quantity the train engine recomputes.
    With ``uniforms`` [B] in (0, 1), each row's token is drawn by inverse transform
    (:func:`inverse_transform`) at its uniform. Without them, ``generator`` (torch's global RNG
    without one) decides: over a vocabulary of more than ``SAMPLE_BLOCK`` entries by inverse
    transform at one uniform a row drawn from it, under it by ``torch.multinomial``. Why two:
    multinomial's exponential race draws one random number per vocabulary entry, 152 of its 190 ms
    for 64 rows of a 152k-token vocabulary on 2 CPU threads (about 30 ms for the whole function by
    inverse transform), while under a thousand entries it costs about 0.1 ms a step; keeping it
    there keeps the draws, and so the learning curves, of the runs and tests that sample a small
    vocabulary (the character tokenizer's) as they were.
    """
    scaled = logits.float() if temperature == 1.0 else logits.float() / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    allowed = logp
    vocab = logp.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(allowed, top_k, dim=-1).values[:, -1:]
        allowed = allowed.masked_fill(allowed < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logp, order = torch.sort(allowed, dim=-1, descending=True)
        sorted_p = sorted_logp.exp()
        # Keep the smallest set of top tokens whose mass reaches top_p: drop a token when the ones
        # ranked above it already cover top_p (the first always stays).
        drop = (sorted_p.cumsum(dim=-1) - sorted_p) >= top_p
        drop[:, 0] = False
        sorted_logp = sorted_logp.masked_fill(drop, float("-inf"))
        allowed = torch.full_like(allowed, float("-inf")).scatter(-1, order, sorted_logp)
    if uniforms is None and vocab <= SAMPLE_BLOCK:
        tokens = torch.multinomial(allowed.exp(), 1, generator=generator).squeeze(1)
    else:
        if uniforms is None:
            uniforms = torch.rand(logp.shape[0], generator=generator, dtype=torch.float64,
                                  device=generator.device if generator is not None else logp.device)
        tokens = inverse_transform(allowed.exp(), uniforms)
    return tokens, logp.gather(1, tokens.unsqueeze(1)).squeeze(1)


SAMPLE_BLOCK = 1024  # vocabulary entries a block of inverse_transform's first level


def inverse_transform(probs: Tensor, uniforms: Tensor) -> Tensor:
    """Per row of ``probs`` [B, V] (unnormalised, >= 0, each row's sum > 0), the first token whose
    cumulative probability reaches ``uniforms`` [B] (in (0, 1)) times the row's sum: a draw from the
    row's distribution, never a token of probability 0. Sums in float64.

    Over a vocabulary of more than ``SAMPLE_BLOCK`` entries in two levels: the blocks' sums and
    the block the draw falls in, then a cumulative sum inside that block only. Why: a cumulative sum
    is sequential along the row, and in float64 over a 152k vocabulary it was a third of the
    sampling (23 of 66 ms for 64 rows, plus 15 ms of conversion)."""
    vocab = probs.shape[1]
    u = uniforms.to(device=probs.device, dtype=torch.float64)
    tiny = torch.finfo(torch.float64).tiny  # a point > 0 never stops on the zeros before a token
    if vocab <= SAMPLE_BLOCK:
        cdf = probs.to(torch.float64).cumsum(dim=-1)
        point = (u * cdf[:, -1]).clamp_(min=tiny).unsqueeze(1)
        return torch.searchsorted(cdf, point).squeeze(1).clamp_(max=vocab - 1)
    full = vocab // SAMPLE_BLOCK
    # each block summed in the probabilities' dtype (a float64 sum would convert the whole row first)
    sums = probs.unfold(1, SAMPLE_BLOCK, SAMPLE_BLOCK).sum(dim=-1)  # [B, full], over views
    if vocab > full * SAMPLE_BLOCK:
        sums = torch.cat([sums, probs[:, full * SAMPLE_BLOCK:].sum(dim=-1, keepdim=True)], 1)
    block_cdf = sums.to(torch.float64).cumsum(dim=-1)
    point = (u * block_cdf[:, -1]).clamp_(min=tiny)
    block = torch.searchsorted(block_cdf, point.unsqueeze(1)).squeeze(1).clamp_(max=block_cdf.shape[1] - 1)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)
    index = block.unsqueeze(1) * SAMPLE_BLOCK + torch.arange(SAMPLE_BLOCK, device=probs.device)  # [B, block]
    inside = probs.gather(1, index.clamp(max=vocab - 1)).to(torch.float64).masked_fill_(index >= vocab, 0.0)
    cdf = inside.cumsum(dim=-1)
    # the two levels round apart: the remainder kept within the block's own sum, and above 0
    rest = torch.minimum(point - before, cdf[:, -1]).clamp_(min=tiny)
    offset = torch.searchsorted(cdf, rest.unsqueeze(1)).squeeze(1).clamp_(max=SAMPLE_BLOCK - 1)
    return (block * SAMPLE_BLOCK + offset).clamp_(max=vocab - 1)


class _Decoder(Protocol):
    """A model with a per-row KV cache: prefill prompts, then one token per row at a time."""

    width: int  # the hidden size: a forward over n rows is n x width^2 of work (core_share.py)

    def prefill(self, input_ids: Tensor, lengths: Tensor, expand: Tensor, max_new_tokens: int) -> Tensor: ...

    def step(self, tokens: Tensor, positions: Tensor) -> Tensor: ...

    def keep(self, slots: Tensor) -> None: ...


class _FunctionalDecoder:
    def __init__(self, fn: FunctionalForward, cache: KVCache) -> None:
        self.fn = fn
        self.cache = cache
        self.width = fn.hidden
        self.step_index = 0  # generated tokens fed so far = generated columns written

    def prefill(self, input_ids: Tensor, lengths: Tensor, expand: Tensor, max_new_tokens: int) -> Tensor:
        kv: list[tuple[Tensor, Tensor]] = []
        hidden, _ = self.fn.forward_packed(input_ids, lengths, kv_out=kv)
        self.cache.start(kv, lengths, expand.tolist(), columns=max_new_tokens - 1)  # the last token is never fed
        self.step_index = 0
        last = lengths.cumsum(0) - 1  # packed index of each prompt's last token
        return self.fn.logits(hidden.index_select(0, last)).index_select(0, expand)

    def step(self, tokens: Tensor, positions: Tensor) -> Tensor:
        logits = self.fn.decode_step(tokens, positions, self.cache, self.step_index)
        self.step_index += 1
        return logits

    def keep(self, slots: Tensor) -> None:
        self.cache.select_rows(slots.tolist(), self.step_index)


class _HFDecoder:
    """Fallback for architectures the functional forward does not cover: HF forward + DynamicCache.

    Prompts are right-padded, so the cache columns of a row are [its prompt, padding, generated
    tokens]. Two things keep that equal to an unpadded forward: ``position_ids`` are passed
    explicitly (row i's prompt sits at 0..len_i-1 and its generated token t at len_i + t; a model
    left to infer them from the cache length would put every row at width + t, which shifts
    RoPE angles and, for GPT-2's learned table, reads the wrong rows), and the attention mask
    keeps the padding columns masked for every later query.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.width = int(model.config.get_text_config().hidden_size)
        self.cache: DynamicCache | None = None
        self.mask: Tensor | None = None  # [B, columns] 1 = real key

    def prefill(self, input_ids: Tensor, lengths: Tensor, expand: Tensor, max_new_tokens: int) -> Tensor:
        batch, length = input_ids.shape
        columns = torch.arange(length, device=input_ids.device)
        mask = (columns.unsqueeze(0) < lengths.unsqueeze(1)).long()
        self.cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=input_ids, attention_mask=mask, position_ids=columns.expand(batch, length),
            past_key_values=self.cache, use_cache=True,
        )
        self.cache.batch_select_indices(expand)
        self.mask = mask.index_select(0, expand)
        last = out.logits[torch.arange(batch, device=input_ids.device), lengths - 1]
        return last.index_select(0, expand)

    def step(self, tokens: Tensor, positions: Tensor) -> Tensor:
        assert self.mask is not None
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=1)
        out = self.model(
            input_ids=tokens.unsqueeze(1), attention_mask=self.mask, position_ids=positions.unsqueeze(1),
            past_key_values=self.cache, use_cache=True,
        )
        return out.logits[:, -1]

    def keep(self, slots: Tensor) -> None:
        assert self.cache is not None and self.mask is not None
        self.cache.batch_select_indices(slots)
        self.mask = self.mask.index_select(0, slots)


class BatchedRolloutEngine(ABC):
    """``generate``: shared-prompt prefill, the sampling loop, EOS stop and compaction, over a decoder.

    A subclass says where the model is (``_decoder``); ``TorchRolloutEngine`` holds a Hugging
    Face module, ``streamrl.engines.tp_rollout.TensorParallelRolloutEngine`` one tensor-parallel
    rank of the fused inference layout. Both share this loop, so their semantics cannot drift.
    """

    def __init__(self, eos_token_id: int, pad_token_id: int, device: torch.device, compact_below: float) -> None:
        """``compact_below``: drop finished rows from the cache when the live fraction falls below this."""
        self.device = device
        self.eos_token_id = int(eos_token_id)
        self.pad_token_id = int(pad_token_id)
        if not 0.0 <= compact_below <= 1.0:
            raise GenerateArgumentError(f"compact_below must be in [0, 1], got {compact_below}")
        self.compact_below = compact_below
        self._cache: KVCache | None = None  # reused across generate calls (see KVCache)

    @abstractmethod
    def _decoder(self) -> _Decoder:
        """A decoder over the current weights, for one ``generate`` call."""

    def _generation_scope(self) -> AbstractContextManager[None]:
        """Entered around the decoding of one ``generate`` call (e.g. a module's eval mode)."""
        return nullcontext()

    def _sample(
        self, logits: Tensor, *, temperature: float, top_k: int, top_p: float, generator: torch.Generator | None,
        uniforms: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Tokens [B] and their logprobs [B] for the logits [B, V] of one step (``uniforms``: each
        row's draw, see :func:`sample_tokens`)."""
        return sample_tokens(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator,
                             uniforms=uniforms)

    def _functional_decoder(self, fn: FunctionalForward, dtype: torch.dtype, device: torch.device) -> _Decoder:
        """A decoder over ``fn`` with this engine's KV cache, rebuilt when its shape or dtype changed."""
        if (
            self._cache is None or self._cache.dtype != dtype or self._cache.device != device
            or self._cache.n_layers != fn.n_layers or self._cache.kv_heads != fn.n_kv_heads
            or self._cache.head_dim != fn.head_dim
        ):
            self._cache = KVCache(fn.n_layers, fn.n_kv_heads, fn.head_dim, dtype=dtype, device=device)
        return _FunctionalDecoder(fn, self._cache)

    def release_cache(self) -> None:
        """Free the KV-cache buffers kept between calls (they are rebuilt on the next generate)."""
        self._cache = None

    def _check(self, prompts: list[Tensor], max_new_tokens: int, temperature: float, top_p: float, top_k: int) -> None:
        if not prompts:
            raise GenerateArgumentError("prompts is empty; pass at least one 1-D int64 tensor of token ids")
        for i, p in enumerate(prompts):
            if not isinstance(p, Tensor) or p.dim() != 1 or p.dtype != torch.int64 or p.numel() == 0:
                raise GenerateArgumentError(
                    f"prompts[{i}] must be a non-empty 1-D int64 tensor of token ids, got "
                    f"{type(p).__name__} {getattr(p, 'dtype', '')} shape {tuple(getattr(p, 'shape', ()))}"
                )
        if max_new_tokens < 1:
            raise GenerateArgumentError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not temperature > 0.0:
            raise GenerateArgumentError(f"temperature must be > 0, got {temperature} (use top_k=1 for greedy)")
        if not 0.0 < top_p <= 1.0:
            raise GenerateArgumentError(f"top_p must be in (0, 1], got {top_p}")
        if top_k < 0:
            raise GenerateArgumentError(f"top_k must be >= 0 (0 = off), got {top_k}")

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[Tensor],
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        streams: Sequence[tuple[int, int]] | None = None,
    ) -> list[Generation]:
        """One completion per prompt (pass a prompt n times for n completions).

        ``seed`` makes the call reproducible (a fresh generator); ``generator`` continues a
        caller's stream; neither = torch's global RNG on the engine's device. ``streams``: each
        prompt's own (seed, index of its first draw) instead (see the module doc).
        """
        self._check(prompts, max_new_tokens, temperature, top_p, top_k)
        device = self.device
        if generator is None and seed is not None:
            generator = torch.Generator(device=device).manual_seed(seed)
        row_streams = None if streams is None else torch.tensor(
            check_streams(streams, len(prompts)), dtype=torch.int64, device=device)

        # Identical prompts share one prefill row.
        unique: dict[tuple[int, ...], int] = {}
        expand_host = [unique.setdefault(tuple(p.tolist()), len(unique)) for p in prompts]
        unique_prompts = list(unique)
        lengths_host = [len(p) for p in unique_prompts]
        width = max(lengths_host)
        padded = torch.full((len(unique_prompts), width), self.pad_token_id, dtype=torch.int64)
        for row, p in enumerate(unique_prompts):
            padded[row, : len(p)] = torch.tensor(p, dtype=torch.int64)
        lengths = torch.tensor(lengths_host, dtype=torch.int64)
        expand = torch.tensor(expand_host, dtype=torch.int64, device=device)

        ok = False
        try:
            with self._generation_scope():
                decoder = self._decoder()
                rebalance(work(padded.numel(), decoder.width))  # this call's share of the cores (core_share.py)
                logits = decoder.prefill(
                    padded.to(device), lengths.to(device), expand, max_new_tokens
                )
                generations = self._sample_loop(
                    decoder, logits, lengths.to(device).index_select(0, expand), max_new_tokens,
                    temperature=temperature, top_k=top_k, top_p=top_p, generator=generator, streams=row_streams,
                )
            ok = True
            return generations
        finally:
            if not ok:
                self._cache = None  # never reuse buffers a failed call may have left non-finite

    def _sample_loop(
        self,
        decoder: _Decoder,
        logits: Tensor,
        positions: Tensor,
        max_new_tokens: int,
        *,
        temperature: float,
        top_k: int,
        top_p: float,
        generator: torch.Generator | None,
        streams: Tensor | None = None,
    ) -> list[Generation]:
        """``streams`` [n, 2] int64: each row's (seed, index of its first draw)."""
        n = logits.shape[0]
        device = logits.device
        out_tokens = torch.empty((n, max_new_tokens), dtype=torch.int64, device=device)
        out_logprobs = torch.empty((n, max_new_tokens), dtype=torch.float32, device=device)
        slot_rows = torch.arange(n, device=device)  # which output row each cache slot fills
        rows_host = list(range(n))
        alive = [True] * n  # per slot; a dead slot keeps computing until the next compaction
        finish: list[FinishReason] = ["length"] * n
        length = [max_new_tokens] * n
        for t in range(max_new_tokens):
            uniforms = None if streams is None else stream_uniforms(streams[:, 0], streams[:, 1] + t)
            tokens, logprobs = self._sample(
                logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator, uniforms=uniforms
            )
            out_tokens[slot_rows, t] = tokens
            out_logprobs[slot_rows, t] = logprobs
            n_alive = 0
            for slot, is_eos in enumerate((tokens == self.eos_token_id).tolist()):
                if alive[slot] and is_eos:
                    alive[slot] = False
                    finish[rows_host[slot]] = "eos"
                    length[rows_host[slot]] = t + 1
                n_alive += alive[slot]
            if n_alive == 0 or t + 1 == max_new_tokens:
                break  # rows still alive keep length max_new_tokens, finish "length"
            if n_alive < self.compact_below * len(rows_host):
                keep_host = [slot for slot, a in enumerate(alive) if a]
                keep = torch.tensor(keep_host, dtype=torch.int64, device=device)
                decoder.keep(keep)
                slot_rows, positions, tokens = slot_rows[keep], positions[keep], tokens[keep]
                if streams is not None:
                    streams = streams[keep]
                rows_host = [rows_host[slot] for slot in keep_host]
                alive = [True] * len(keep_host)
            rebalance(work(len(rows_host), decoder.width), DECODE_GRAIN)  # this step's share of the cores (core_share.py)
            logits = decoder.step(tokens, positions + t)  # token t sits at position prompt_len + t
        # Each row's first length[row] columns, cut from one flat copy: two ops for the batch instead
        # of a slice and a clone per row (a W1 call's 64 rows: 0.07 against 0.30 ms). Each
        # completion is a contiguous view of its batch's flat tensor.
        kept = (torch.arange(max_new_tokens, device=device).unsqueeze(0)
                < torch.tensor(length, device=device).unsqueeze(1))
        tokens = out_tokens[kept].cpu().split(length)
        logprobs = out_logprobs[kept].cpu().split(length)
        return [Generation(t, lp, f) for t, lp, f in zip(tokens, logprobs, finish, strict=True)]


class TorchRolloutEngine(BatchedRolloutEngine):
    """Sample completions from a Hugging Face causal LM held in this process (the ``builtin`` engine
    of :class:`~streamrl.engines.rollout_engine.RolloutEngine`).

    ``model`` is used in place (moved to ``device``): weights updated elsewhere in the process
    (a train engine sharing the module, ``load_state_dict``) are used by the next ``generate``.
    """

    def __init__(
        self,
        model: nn.Module,
        eos_token_id: int,
        pad_token_id: int,
        device: str | torch.device = "auto",
        *,
        use_functional: bool | None = None,
        compact_below: float = 0.75,
    ) -> None:
        """``use_functional``: None = functional forward when the architecture allows, else HF.
        ``compact_below``: drop finished rows from the cache when the live fraction falls below this."""
        super().__init__(eos_token_id, pad_token_id, resolve_device(device), compact_below)
        self.model = model.to(self.device)
        reason = unsupported_reason(model)
        if use_functional and reason is not None:
            raise GenerateArgumentError(f"use_functional=True but {reason}; pass use_functional=None")
        self.use_functional = reason is None if use_functional is None else use_functional
        self.forward_path: RolloutForwardPath = "functional" if self.use_functional else "hf"
        model_type = getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__
        # Said once here, not per call: the HF path is several times slower per token, and a run
        # that lands on it (a new architecture, an unusual rope type) should show why in its log.
        if self.use_functional:
            log.info("rollout forward: functional (%s)", model_type)
        else:
            why = reason if reason is not None else "use_functional=False"
            log.info("rollout forward: Hugging Face module with KV cache (%s: %s)", model_type, why)
        # A learned position table (GPT-2's wpe) has no row past its end, so a too-long prompt +
        # completion would fail deep inside the forward with a bare IndexError; RoPE models run
        # any position and are checked against what they advertise by the pipeline instead.
        wpe = getattr(getattr(model, "base_model", None), "wpe", None)
        self.position_table: int | None = wpe.num_embeddings if isinstance(wpe, nn.Embedding) else None

    def _check(self, prompts: list[Tensor], max_new_tokens: int, temperature: float, top_p: float, top_k: int) -> None:
        super()._check(prompts, max_new_tokens, temperature, top_p, top_k)
        if self.position_table is not None:
            longest = max(p.numel() for p in prompts)
            # The last sampled token is never fed, so the highest position run is longest + max_new_tokens - 2.
            if longest + max_new_tokens - 1 > self.position_table:
                raise GenerateArgumentError(
                    f"a prompt of {longest} tokens + max_new_tokens={max_new_tokens} needs positions up to "
                    f"{longest + max_new_tokens - 2}, but the model's learned position table has "
                    f"{self.position_table} rows (0..{self.position_table - 1}); lower max_new_tokens or "
                    "shorten the prompts"
                )

    name = "builtin"
    startup_s = 0.0  # the model is built by the caller; nothing else starts
    load_weights_is_local = True  # a copy into the module's tensors

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Take new policy weights (e.g. a published version from the trainer), in place.

        Where ``state`` names exactly the module's tensors with their shapes, one foreach copy
        takes them all: ``nn.Module.load_state_dict`` walks the module and copies tensor by tensor
        (0.25 against 0.08 ms for W1's model, paid at every version). Anything else (a name
        missing or extra, another shape or device, a tensor subclass such as a DTensor) goes through
        ``load_state_dict``, which says what does not match."""
        targets = self.model.state_dict(keep_vars=True)  # the module's own tensors, looked up now: it may be shared
        if state.keys() == targets.keys():
            dst = [targets[k] for k in state]
            src = list(state.values())
            if all(type(d) in _PLAIN and type(t) in _PLAIN and d.shape == t.shape and d.device == t.device
                   for d, t in zip(dst, src, strict=True)):
                with torch.no_grad():
                    torch._foreach_copy_(dst, src)
                return
        self.model.load_state_dict(state, strict=True)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """The rollout-engine interface's install: every parameter, by Hugging Face name."""
        self.load_state_dict(dict(weights))

    def close(self) -> None:
        self.release_cache()

    @property
    def generator_device(self) -> torch.device:
        return self.device  # sampling runs on the model's device

    def _decoder(self) -> _Decoder:
        if not self.use_functional:
            return _HFDecoder(self.model)
        weight = self.model.get_input_embeddings().weight
        # Built per call: it copies the fused projections from the module's weights of the moment.
        # the cache holds keys and values in the dtype attention computes in (float32 for a
        # half-precision model on a CPU: streamrl.models.matmul_precision.attention_dtype)
        return self._functional_decoder(FunctionalCausalLM(self.model), attention_dtype(weight.dtype, weight.device),
                                        weight.device)

    @contextmanager
    def _generation_scope(self) -> Iterator[None]:
        was_training = self.model.training
        if not was_training or self.use_functional:
            # the generator's own module stays in eval mode; the functional forward reads the weights
            # and never the module's mode (no dropout): a module in training mode (the train stage's
            # own, options.rollout) is not walked twice a call either (0.4 ms for W1's model)
            yield
            return
        self.model.eval()  # no dropout while sampling; the caller's mode comes back afterwards
        try:
            yield
        finally:
            self.model.train(was_training)
