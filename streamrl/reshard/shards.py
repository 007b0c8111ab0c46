"""Where each training rank's shard sits inside the full tensor.

A parameter of full shape S is first split along its ``train_tp_dim`` into P equal TP chunks
(none when it is replicated over TP). Each TP-local chunk of shape S_tp is then split along
dim 0 into ``dp`` shards of ``ceil(S_tp[0] / dp)`` rows, FSDP2 style; the last shards are
zero-padded so every rank holds the same number of elements (equal sizes make the all-gather a
single flat collective). A :class:`Block` is the rectangle of the full tensor that one rank's
shard really holds (padding excluded) and the padded shape it is stored in; local row 0 of the
shard is the block's first row.

:func:`flat_range_rects` cuts a flat (row-major) element range of a rectangle into row-aligned
sub-rectangles: the disaggregated reshard streams each destination's pieces in bounded chunks,
and a chunk boundary may fall anywhere inside a piece.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from math import prod

import torch

from streamrl.reshard.layout import TrainLayout
from streamrl.reshard.spec import ParamSpec, Rect, intersect, rect_shape


@dataclass(frozen=True)
class Block:
    rect: Rect | None  # None when this rank's shard is all padding
    local_shape: tuple[int, ...]  # padded shape of the stored shard

    @property
    def local_numel(self) -> int:
        return prod(self.local_shape)


def tp_local_shape(param: ParamSpec, layout: TrainLayout) -> tuple[int, ...]:
    shape = list(param.shape)
    if param.train_tp_dim is not None:
        shape[param.train_tp_dim] //= layout.tensor_parallel
    return tuple(shape)


def local_shape(param: ParamSpec, layout: TrainLayout) -> tuple[int, ...]:
    """Padded shape of the dim-0 shard every rank stores (the same on all ranks)."""
    tp_shape = tp_local_shape(param, layout)
    rows = -(-tp_shape[0] // layout.data_parallel)
    return (rows, *tp_shape[1:])


def train_block(param: ParamSpec, layout: TrainLayout, rank: int) -> Block:
    dp_rank, tp_rank = layout.coords(rank)
    tp_shape = tp_local_shape(param, layout)
    shard_shape = local_shape(param, layout)
    origin = [0] * len(param.shape)
    if param.train_tp_dim is not None:
        origin[param.train_tp_dim] = tp_rank * tp_shape[param.train_tp_dim]
    first = dp_rank * shard_shape[0]
    rows = max(0, min(shard_shape[0], tp_shape[0] - first))
    if rows == 0:
        return Block(None, shard_shape)
    rect = [(o, o + n) for o, n in zip(origin, tp_shape, strict=True)]
    rect[0] = (origin[0] + first, origin[0] + first + rows)
    return Block(tuple(rect), shard_shape)


def source_blocks(param: ParamSpec, layout: TrainLayout) -> list[tuple[int, Block]]:
    """(rank, block) of the ranks to read ``param`` from: one per distinct non-empty rectangle.

    A TP-replicated parameter (a norm) is held identically by the P ranks of each TP group;
    reading it once avoids copying the same bytes P times.
    """
    seen: set[Rect] = set()
    out = []
    for rank in range(layout.world_size):
        block = train_block(param, layout, rank)
        if block.rect is not None and block.rect not in seen:
            seen.add(block.rect)
            out.append((rank, block))
    return out


def rect_in(tensor: torch.Tensor, rect: Rect, origin: tuple[int, ...]) -> torch.Tensor:
    """View of ``tensor`` for the full-coordinate ``rect``, where ``tensor[0, 0, ...]`` sits at ``origin``."""
    return tensor[tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(rect, origin, strict=True))]


def starts(rect: Rect) -> tuple[int, ...]:
    return tuple(lo for lo, _ in rect)


def shard_tensor(full: torch.Tensor, param: ParamSpec, layout: TrainLayout, rank: int) -> torch.Tensor:
    """This rank's padded shard of a full tensor (a fresh tensor; padding rows are zero)."""
    if tuple(full.shape) != param.shape:
        raise ValueError(f"{param.name}: full tensor has shape {tuple(full.shape)}, spec says {param.shape}")
    block = train_block(param, layout, rank)
    out = torch.zeros(block.local_shape, dtype=full.dtype, device=full.device)
    if block.rect is not None:
        rect_in(out, block.rect, starts(block.rect)).copy_(rect_in(full, block.rect, (0,) * full.dim()))
    return out


def shard_state(
    full_state: Mapping[str, torch.Tensor],
    params: tuple[ParamSpec, ...],
    layout: TrainLayout,
    rank: int,
    *,
    device: torch.device | None = None,
) -> dict[str, torch.Tensor]:
    """Shards of every parameter for ``rank`` (used to build an engine or a benchmark's shards)."""
    missing = [p.name for p in params if p.name not in full_state]
    if missing:
        raise KeyError(f"full state lacks {len(missing)} parameters of the spec, e.g. {missing[:3]}")
    return {
        p.name: shard_tensor(full_state[p.name].detach(), p, layout, rank).to(device or "cpu") for p in params
    }


def copy_rect(
    dst: torch.Tensor,
    dst_origin: tuple[int, ...],
    src_rect: Rect,
    blocks: list[tuple[Rect, torch.Tensor]],
) -> int:
    """Fill ``dst`` (whose [0, ...] corresponds to ``src_rect``'s start shifted to ``dst_origin``)
    from the shards covering ``src_rect``. Returns the number of elements copied.

    ``blocks`` holds (valid rect, shard view) pairs: every rank's shard of one parameter.
    """
    copied = 0
    for block_rect, shard in blocks:
        part = intersect(src_rect, block_rect)
        if part is None:
            continue
        target = tuple(
            (lo - s0 + o, hi - s0 + o)
            for (lo, hi), (s0, _), o in zip(part, src_rect, dst_origin, strict=True)
        )
        rect_in(dst, target, (0,) * dst.dim()).copy_(
            rect_in(shard, part, starts(block_rect)), non_blocking=True
        )
        copied += prod(rect_shape(part))
    return copied


def flat_range_rects(rect: Rect, start: int, stop: int) -> Iterator[Rect]:
    """The sub-rectangles of ``rect`` that hold its elements [start, stop) in row-major order.

    ``rect`` flattened row-major (in its own shape, ``rect_shape(rect)``) is a stream of elements;
    the range [start, stop) of that stream is yielded as rectangles (same coordinates as ``rect``)
    in stream order, so concatenating each one flattened gives back exactly that range. A 1-D rect
    gives one range; a 2-D one at most 3 (the rest of a first partial row, the full rows, the start
    of a last partial row); N-D recurses into the partial dim-0 slices. An empty range yields nothing.
    """
    shape = rect_shape(rect)
    if not 0 <= start <= stop <= prod(shape):
        raise ValueError(f"flat range [{start}, {stop}) is not within the {prod(shape)} elements of {rect}")
    if start == stop:
        return
    if not rect:  # a 0-d tensor: one element, the empty rect
        yield rect
        return
    (lo, _), rest = rect[0], rect[1:]
    inner = prod(shape[1:])  # elements per dim-0 slice ("row")
    row, col = divmod(start, inner)
    if col:  # start inside a row: the rest of that row (or less, if the range ends in it)
        end = min(stop, (row + 1) * inner)
        for sub in flat_range_rects(rest, col, end - row * inner):
            yield ((lo + row, lo + row + 1), *sub)
        row, start = row + 1, end
    full = (stop - start) // inner
    if full:
        yield ((lo + row, lo + row + full), *rest)
        row, start = row + full, start + full * inner
    if start < stop:  # the start of a last row
        for sub in flat_range_rects(rest, 0, stop - start):
            yield ((lo + row, lo + row + 1), *sub)
