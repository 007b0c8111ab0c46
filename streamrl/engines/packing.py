"""Response-token logprobs through a Hugging Face module's own forward, with shared prompts packed.

A GRPO micro-batch holds G completions of each prompt. Fed as right-padded prompt+response rows,
every prompt is computed G times and every row is as wide as the longest one. Here each
distinct prompt is computed once:

    row:  [ prompt | c1[:-1] | c2[:-1] | ... ]        (the last response token is never an input)

with ``position_ids`` restarting after the prompt for every completion and a 4-D attention mask
in which a prompt token sees the prompt causally and a completion token sees the prompt and its
own completion causally, nothing else. The logits that predict response token j of completion c
are at the prompt's last position (j = 0) or at c's input token j - 1. The maths is the padded
forward's exactly (tests/engines/test_packing.py: equal within float rounding).

The mask goes through the module's own attention (``sdpa``: boolean, True = attend; ``eager``: an
additive float mask), so this works for any architecture whose attention takes a prepared 4-D
mask and whose positions come from ``position_ids`` (transformers returns a 4-D mask as given).
Whether a model does is *checked* once per engine (:func:`probe_packing`: packed vs padded on a
tiny batch before sharding); where it does not, the padded rows are used and the log says why.
Where the attention is ``sdpa``, the rows' layout goes to the model's forward too, and the
shared-prefix attention (:mod:`streamrl.engines.prefix_attention`) computes the same attention
without the dense mask's ``width^2`` cost (checked the same way: :func:`probe_shared_prefix`).
With it a row holds several groups, one after the other, ``[prompt1 | c.. | prompt2 | c.. ]``, until
``max_row_tokens``: rows are filled instead of padded to the widest group.

A row holds at most ``max_row_tokens`` tokens (its mask is rows x width^2): a group whose
completions do not fit is split over several rows, each repeating the prompt.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor, nn

from streamrl.models.fused_norm import fuse_rms_norms
from streamrl.models.matmul_precision import ieee_matmuls

if TYPE_CHECKING:
    from streamrl.engines.prefix_attention import SharedPrefixLayout

ForwardPath = Literal["packed", "padded"]
DEFAULT_MAX_ROW_TOKENS = 4096  # tokens per packed row: its mask costs width^2 bools (16 MiB at 4096)
# A micro-batch takes the shared-prefix attention, in filled rows, when one prompt group per row
# would make rows at least this wide (tokens): there the dense mask's width^2 and the padding cost
# more than the layout's gathers (a train step 1.00-1.16x at rows ~104 tokens (widest 124) and
# 1.09-1.24x at ~186 (widest 216), hidden 128-512, one or two threads; 0.80-0.97x at ~41 tokens,
# W1's; 2x at 2190; docs/benchmarks.md §18, §42) ...
DEFAULT_SHARED_PREFIX_MIN_WIDTH = 128
# ... or would pad at least this many tokens (rows x widest - real tokens): the filled rows' linear
# layers then skip them, worth the gathers even where the attention alone is not (W3-like 70-token
# rows of 32 groups: 800 of 2180 tokens, 1.16-1.3x; W1: ~35 tokens of padding, 0.9x)
DEFAULT_SHARED_PREFIX_MIN_PADDING = 256
PROBE_TOLERANCE = 1e-4  # packed vs padded logprob difference (float32) that still counts as the same maths


@dataclass(frozen=True)
class ModelInputs:
    """What one forward takes, and where each response token's predicting logits sit."""

    kwargs: dict[str, Tensor]  # input_ids, attention_mask (, position_ids)
    rows: Tensor  # [N] flat index into the [B * (width - start)] kept logits, one per response token
    start: int  # first kept position: logits before it only ever predict prompt tokens
    width: int
    # packed rows only: where the prompt and completions sit, for the shared-prefix attention
    # (streamrl/engines/prefix_attention.py); passed to the model's forward, which hands it to attention
    shared_prefix: SharedPrefixLayout | None = None


def flat_response_index(response_ids: Sequence[Tensor], device: torch.device) -> tuple[Tensor, Tensor]:
    """(seq_index, offset) of every response token: which sample, and its position in the response."""
    lens = torch.tensor([r.numel() for r in response_ids], device=device)
    seq_index = torch.repeat_interleave(torch.arange(len(response_ids), device=device), lens)
    offset = torch.arange(seq_index.numel(), device=device) - (lens.cumsum(0) - lens)[seq_index]
    return seq_index, offset


def padded_inputs(prompt_ids: Sequence[Tensor], response_ids: Sequence[Tensor], device: torch.device,
                  keep_from_first: bool = True) -> ModelInputs:
    """Right-padded prompt+response rows (one per sample), the fallback layout."""
    inputs = [torch.cat([p, r[:-1]]) for p, r in zip(prompt_ids, response_ids, strict=True)]
    lengths = torch.tensor([x.numel() for x in inputs], device=device)
    width = int(lengths.max())
    padded = torch.nn.utils.rnn.pad_sequence(inputs, batch_first=True).to(device)
    mask = torch.arange(width, device=device).unsqueeze(0) < lengths.unsqueeze(1)
    first = torch.tensor([p.numel() - 1 for p in prompt_ids], device=device)
    start = int(first.min()) if keep_from_first else 0
    seq_index, offset = flat_response_index(response_ids, device)
    rows = seq_index * (width - start) + first[seq_index] + offset - start
    return ModelInputs({"input_ids": padded, "attention_mask": mask.long()}, rows, start, width)


def packed_inputs(prompt_ids: Sequence[Tensor], response_ids: Sequence[Tensor], device: torch.device, *,
                  mask_dtype: torch.dtype | None, max_row_tokens: int = DEFAULT_MAX_ROW_TOKENS,
                  keep_from_first: bool = True, shared_prefix: bool = False,
                  shared_prefix_min_width: int = 0, shared_prefix_min_padding: int = 0,
                  dense_mask: bool = False) -> ModelInputs:
    """Shared-prompt rows (see the module doc). ``mask_dtype`` None: a boolean mask (sdpa), else an
    additive mask of that dtype (eager attention).

    ``shared_prefix``: the rows' layout for :mod:`streamrl.engines.prefix_attention` when one group
    per row would be at least ``shared_prefix_min_width`` tokens wide or pad at least
    ``shared_prefix_min_padding`` tokens. The rows are then filled (several groups per row, each a
    prompt occurrence of its own) and the mask is a placeholder the layout's attention never reads
    (``dense_mask``: build the real one anyway, for tests that compare the two)."""
    # group samples by prompt content, in order of first appearance
    group_of: dict[tuple[int, ...], int] = {}
    members: list[list[int]] = []
    prompt_lists = [p.tolist() for p in prompt_ids]
    for i, p in enumerate(prompt_lists):
        g = group_of.setdefault(tuple(p), len(members))
        if g == len(members):
            members.append([])
        members[g].append(i)
    inputs = [max(r.numel() - 1, 0) for r in response_ids]  # the last response token is never an input
    plan = _plan_rows(members, prompt_ids, inputs, max_row_tokens, fill_to=None)
    widest = max(plan.lengths)
    filled = shared_prefix and (widest >= shared_prefix_min_width
                                or len(plan.lengths) * widest - sum(plan.lengths) >= shared_prefix_min_padding)
    if filled:
        # rows of about equal width: a row is closed once it holds its share of the tokens, so that the
        # last one is not a short row padded to the others' width
        total = sum(plan.lengths)
        plan = _plan_rows(members, prompt_ids, inputs, max_row_tokens,
                          fill_to=-(-total // max(-(-total // max_row_tokens), 1)))
    width = max(plan.lengths)
    B = len(plan.lengths)
    layout = None
    if filled:
        # imported here: it registers with transformers' model code, which the launcher's pipeline
        # checks (importing this module through the stages) must not load
        from streamrl.engines.prefix_attention import SharedPrefixLayout

        completions = [(occ, input_start, inputs[i]) for i, (occ, _, input_start) in enumerate(plan.placed)
                       if inputs[i]]
        layout = SharedPrefixLayout.build([(row, first, P) for row, first, P, _ in plan.occurrences],
                                          completions, width, device)
    # The rows are filled as flat Python lists and made tensors once: a slice assignment per
    # sample and column into tensors costs a W1 micro-batch (64 samples of <= 4 tokens) about a
    # sixth of its train step in dispatch alone.
    ids, positions = [0] * (B * width), [0] * (B * width)
    occurrences = [-1] * (B * width)  # per token: its prompt occurrence; -1: padding
    segments = [0] * (B * width)  # per token: 0 in the prompt, k in its k-th completion
    for occ, (row, first, P, sample) in enumerate(plan.occurrences):
        at = row * width + first
        ids[at:at + P] = prompt_lists[sample]
        positions[at:at + P] = range(P)
        occurrences[at:at + P] = [occ] * P
    # for sample i: (row, position predicting its token 0, position of its first input token)
    where: list[tuple[int, int, int]] = []
    for i, (occ, seg, input_start) in enumerate(plan.placed):
        row, first, P, _ = plan.occurrences[occ]
        n = inputs[i]
        if n:
            at = row * width + input_start
            ids[at:at + n] = response_ids[i][:-1].tolist()
            positions[at:at + n] = range(P, P + n)
            occurrences[at:at + n] = [occ] * n
            segments[at:at + n] = [seg] * n
        where.append((row, first + P - 1, input_start))
    input_ids = torch.tensor(ids, dtype=torch.int64).view(B, width)
    position_ids = torch.tensor(positions, dtype=torch.int64).view(B, width)
    occurrence = torch.tensor(occurrences, dtype=torch.int64).view(B, width)
    segment = torch.tensor(segments, dtype=torch.int64).view(B, width)
    if layout is not None and not dense_mask:
        # The layout's attention never reads the mask (it refuses a call it cannot serve with the
        # layout alone): a view of one element stands in for rows x width^2, 16 MiB a 4096-token row.
        fill = torch.ones if mask_dtype is None else torch.zeros
        mask = fill(1, 1, 1, 1, dtype=mask_dtype or torch.bool, device=device).expand(B, 1, width, width)
    else:
        mask = _dense_mask(occurrence.to(device), segment.to(device), mask_dtype)
    firsts = [where[i][1] for i in range(len(where))]
    start = min(firsts) if keep_from_first else 0
    seq_index, offset = flat_response_index(response_ids, device)
    row_of = torch.tensor([w[0] for w in where], device=device)[seq_index]
    first = torch.tensor(firsts, device=device)[seq_index]
    input_start = torch.tensor([w[2] for w in where], device=device)[seq_index]
    # token 0 is predicted by the prompt's last position, token j >= 1 by the completion's input j - 1
    position = torch.where(offset == 0, first, input_start + offset - 1)
    rows = row_of * (width - start) + position - start
    kwargs = {"input_ids": input_ids.to(device), "attention_mask": mask, "position_ids": position_ids.to(device)}
    return ModelInputs(kwargs, rows, start, width, layout)


@dataclass(frozen=True)
class _RowPlan:
    """Where :func:`packed_inputs` puts each prompt occurrence and each sample, in tokens."""

    lengths: list[int]  # tokens of each row
    occurrences: list[tuple[int, int, int, int]]  # (row, first position, tokens, a sample of that prompt)
    placed: list[tuple[int, int, int]]  # per sample: (its prompt occurrence, its segment >= 1, first input position)


def _plan_rows(members: Sequence[Sequence[int]], prompt_ids: Sequence[Tensor], inputs: Sequence[int],
               max_row_tokens: int, *, fill_to: int | None) -> _RowPlan:
    """Rows for the prompt groups ``members`` (sample indices; ``inputs[i]``: sample i's input tokens).

    ``fill_to`` None: each group opens a row of its own (the dense mask's rows). Else rows are
    filled: a group's prompt joins the last row while that row is short of ``fill_to`` tokens and the
    prompt and its first completion fit. Either way a group moves on to a new occurrence of its prompt
    (in a new row, or the last one where filling allows) once its row would overflow
    ``max_row_tokens`` (or, filling, holds ``fill_to``): an occurrence always takes its first
    completion, and one with no input token adds nothing, so it never opens one of its own."""
    lengths: list[int] = []
    occurrences: list[tuple[int, int, int, int]] = []
    placed = [(0, 0, 0)] * len(inputs)
    for group in members:
        P = prompt_ids[group[0]].numel()
        row, occ, seg = -1, -1, 0
        for i in group:
            n = inputs[i]
            if occ < 0 or (n and seg > 0 and (lengths[row] + n > max_row_tokens
                                              or (fill_to is not None and lengths[row] >= fill_to))):
                if not (fill_to is not None and lengths and lengths[-1] < fill_to
                        and lengths[-1] + P + n <= max_row_tokens):
                    lengths.append(0)
                row, occ, seg = len(lengths) - 1, len(occurrences), 0
                occurrences.append((row, lengths[row], P, group[0]))
                lengths[row] += P
            seg += 1
            placed[i] = (occ, seg, lengths[row])
            lengths[row] += n
    return _RowPlan(lengths, occurrences, placed)


def _dense_mask(occurrence: Tensor, segment: Tensor, mask_dtype: torch.dtype | None) -> Tensor:
    """[rows, 1, width, width]: a token sees its own prompt occurrence's tokens and, in a completion,
    its own completion's, causally; -1 occurrences are padding. Boolean, or additive of ``mask_dtype``."""
    width = occurrence.shape[1]
    oq, ok = occurrence.unsqueeze(2), occurrence.unsqueeze(1)
    sq, sk = segment.unsqueeze(2), segment.unsqueeze(1)
    causal = torch.ones(width, width, dtype=torch.bool, device=occurrence.device).tril()
    allowed = causal & (ok == oq) & ((sk == 0) | (sk == sq)) & (ok >= 0)
    # a padding query sees itself: a row with nothing to attend to would give NaN in softmax
    allowed |= torch.eye(width, dtype=torch.bool, device=occurrence.device)
    mask = allowed.unsqueeze(1)
    if mask_dtype is not None:
        mask = torch.zeros(mask.shape, dtype=mask_dtype, device=mask.device).masked_fill(
            ~mask, torch.finfo(mask_dtype).min)
    return mask


def attention_mask_dtype(model: nn.Module) -> torch.dtype | None:
    """The 4-D mask form the model's attention takes: None (boolean) for sdpa and the like, float
    (additive) for eager attention."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return torch.float32 if impl == "eager" else None


def model_inputs(path: ForwardPath, prompt_ids: Sequence[Tensor], response_ids: Sequence[Tensor],
                 device: torch.device, *, mask_dtype: torch.dtype | None, max_row_tokens: int,
                 keep_from_first: bool = True, shared_prefix: bool = False,
                 shared_prefix_min_width: int = 0, shared_prefix_min_padding: int = 0) -> ModelInputs:
    if path == "packed":
        return packed_inputs(prompt_ids, response_ids, device, mask_dtype=mask_dtype,
                             max_row_tokens=max_row_tokens, keep_from_first=keep_from_first,
                             shared_prefix=shared_prefix, shared_prefix_min_width=shared_prefix_min_width,
                             shared_prefix_min_padding=shared_prefix_min_padding)
    return padded_inputs(prompt_ids, response_ids, device, keep_from_first=keep_from_first)


def response_logits(model: nn.Module, inputs: ModelInputs) -> Tensor:
    """[N, vocab] logits predicting each response token (the model's dtype), through ``model.__call__``
    (so FSDP2's hooks gather each layer's parameters). Inputs built with ``keep_from_first`` need a
    model whose forward takes ``logits_to_keep`` (:func:`uses_logits_to_keep`)."""
    kwargs: dict[str, object] = {**inputs.kwargs, "use_cache": False}
    if inputs.shared_prefix is not None:
        from streamrl.engines.prefix_attention import IMPLEMENTATION  # loaded already: it built the layout

        impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
        if impl != IMPLEMENTATION:  # its attention would read the placeholder mask, not the layout
            raise ValueError(f"these inputs carry a shared-prefix layout but the model's attention is {impl!r}: "
                             "switch it first (prefix_attention.enable, as probe_shared_prefix does) or build "
                             "the inputs without shared_prefix")
        kwargs["shared_prefix"] = inputs.shared_prefix
    if inputs.start:
        kwargs["logits_to_keep"] = inputs.width - inputs.start
    logits = model(**kwargs).logits
    return logits.reshape(-1, logits.shape[-1]).index_select(0, inputs.rows)


def token_logprobs(logits: Tensor, response_ids: Sequence[Tensor], temperature: float) -> tuple[Tensor, Tensor]:
    """(logprob [N] of each response token, log-softmax over the vocabulary [N, V]), in float32, from
    the [N, V] logits that predict them (:func:`response_logits`)."""
    targets = torch.cat([r.reshape(-1) for r in response_ids]).to(logits.device)
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp_all.gather(1, targets.unsqueeze(1)).squeeze(1), logp_all


def vocab_size(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    return int(getattr(config, "vocab_size", 0) or 0) or int(model.get_input_embeddings().weight.shape[0])


def _probe_batch(model: nn.Module) -> tuple[list[Tensor], list[Tensor]]:
    """Two prompts, two completions each, of different lengths (one completion of a single token)."""
    g = torch.Generator().manual_seed(0)
    high = max(vocab_size(model), 2)
    prompts = [torch.randint(0, high, (n,), generator=g) for n in (5, 3)]
    responses = [torch.randint(0, high, (n,), generator=g) for n in (4, 2, 3, 1)]
    return [prompts[0], prompts[0], prompts[1], prompts[1]], responses


def _packed_vs_padded(model: nn.Module, device: torch.device, *, shared_prefix: bool) -> float:
    """Largest |packed - padded| response logprob on the probe batch (raises what the forward raises)."""
    prompt_ids, responses = _probe_batch(model)
    keep = uses_logits_to_keep(model)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), ieee_matmuls():  # the model's masks and positions, not the run's rounding
            out = {}
            for path in ("padded", "packed"):
                inputs = model_inputs(path, prompt_ids, responses, device, mask_dtype=attention_mask_dtype(model),
                                      max_row_tokens=DEFAULT_MAX_ROW_TOKENS, keep_from_first=keep,
                                      shared_prefix=shared_prefix)
                out[path], _ = token_logprobs(response_logits(model, inputs), responses, 1.0)
    finally:
        model.train(was_training)
    return float((out["packed"] - out["padded"]).abs().max())


def probe_packing(model: nn.Module, device: torch.device) -> tuple[ForwardPath, str]:
    """Whether ``model`` computes shared-prompt rows exactly: packed vs padded logprobs on a tiny
    batch (two prompts, two completions each, different lengths). Returns the path and why."""
    try:
        diff = _packed_vs_padded(model, device, shared_prefix=False)
    except Exception as exc:  # an attention that refuses a 4-D mask or position_ids
        return "padded", f"shared-prompt packing failed on {type(model).__name__} ({type(exc).__name__}: {exc})"
    if not diff <= PROBE_TOLERANCE:
        return "padded", (f"{type(model).__name__} does not honour a 4-D attention mask with position_ids "
                          f"(packed vs padded logprobs differ by {diff:.2g})")
    return "packed", f"{type(model).__name__}: shared prompts packed (packed = padded within {diff:.1g})"


def probe_shared_prefix(model: nn.Module, device: torch.device) -> tuple[bool, str]:
    """Switch a packing model to the shared-prefix attention (:mod:`streamrl.engines.prefix_attention`)
    where it computes the same logprobs as padded rows; returns whether it did, and why. The model's
    attention is left as it was otherwise."""
    from streamrl.engines import prefix_attention  # transformers' model code: see packed_inputs

    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if prefix_attention.UNAVAILABLE is not None:
        return False, f"dense-mask attention ({prefix_attention.UNAVAILABLE})"
    if not prefix_attention.enable(model):
        return False, f"dense-mask attention ({impl} attention: the shared-prefix one replaces sdpa only)"
    calls = prefix_attention.layout_calls
    try:
        diff = _packed_vs_padded(model, device, shared_prefix=True)
    except Exception as exc:
        refused = f"the shared-prefix one failed: {type(exc).__name__}: {exc}"
    else:
        if prefix_attention.layout_calls == calls:
            refused = f"{type(model).__name__} does not pass the layout to its attention"
        elif not diff <= PROBE_TOLERANCE:
            refused = f"shared-prefix vs padded logprobs differ by {diff:.2g}"
        else:
            return True, f"shared-prefix attention (= padded within {diff:.1g})"
    prefix_attention.disable(model)
    return False, f"dense-mask attention ({refused})"


class ResponseForward:
    """One engine's way to its response tokens' logprobs: the model's own forward on shared-prompt
    rows where :func:`probe_packing` shows the model computes them exactly, else on padded rows;
    on shared-prompt rows, with the shared-prefix attention where :func:`probe_shared_prefix` shows
    it computes them exactly too.

    Built on the plain module (the probe's two tiny forwards are no collective): an engine that
    shards the module afterwards keeps calling the same object, now with FSDP2's hooks.
    """

    def __init__(self, model: nn.Module, device: torch.device, *, pack_prompts: bool = True,
                 max_row_tokens: int = DEFAULT_MAX_ROW_TOKENS, shared_prefix: bool = True,
                 shared_prefix_min_width: int = DEFAULT_SHARED_PREFIX_MIN_WIDTH,
                 shared_prefix_min_padding: int = DEFAULT_SHARED_PREFIX_MIN_PADDING) -> None:
        """A micro-batch takes the shared-prefix attention in filled rows where one prompt group per row
        would be ``shared_prefix_min_width`` tokens wide or pad ``shared_prefix_min_padding`` tokens;
        otherwise one group per row with the dense mask (sdpa exactly)."""
        self.model, self.device, self.max_row_tokens = model, device, max_row_tokens
        self.fused_norms = fuse_rms_norms(model)  # before the probes, so they check the forward that runs
        self.shared_prefix_min_width = shared_prefix_min_width
        self.shared_prefix_min_padding = shared_prefix_min_padding
        self.path: ForwardPath = "padded"
        self.why = "pack_prompts is off"
        self.shared_prefix = False
        if pack_prompts:
            self.path, self.why = probe_packing(model, device)
        if self.path == "packed":
            if shared_prefix:
                self.shared_prefix, why = probe_shared_prefix(model, device)
            else:
                why = "dense-mask attention (shared_prefix is off)"
            self.why = f"{self.why}; {why}"
        if self.fused_norms:
            self.why = f"{self.why}; {self.fused_norms} RMSNorm modules on torch's fused rms_norm"
        self.mask_dtype = attention_mask_dtype(model)
        self.keep_from_first = uses_logits_to_keep(model)

    def logprobs(self, prompt_ids: Sequence[Tensor], response_ids: Sequence[Tensor],
                 temperature: float) -> tuple[Tensor, Tensor]:
        """:func:`token_logprobs` of every response token (flat, sample order)."""
        inputs = model_inputs(self.path, prompt_ids, response_ids, self.device, mask_dtype=self.mask_dtype,
                              max_row_tokens=self.max_row_tokens, keep_from_first=self.keep_from_first,
                              shared_prefix=self.shared_prefix, shared_prefix_min_width=self.shared_prefix_min_width,
                              shared_prefix_min_padding=self.shared_prefix_min_padding)
        return token_logprobs(response_logits(self.model, inputs), response_ids, temperature)


def uses_logits_to_keep(model: nn.Module) -> bool:
    """Whether the model's forward can skip the logits of leading positions (transformers' ``logits_to_keep``)."""
    return "logits_to_keep" in inspect.signature(type(model).forward).parameters
