"""The tensor codec: every dtype and shape round-trips, and each buffer-lifetime rule holds."""

from __future__ import annotations

import gc
import itertools

import pytest
import torch
import zmq

from streamrl.dock.codec import (
    ALIGN,
    ITEMSIZES,
    ZERO_COPY_BYTES,
    RawValue,
    decode_columns,
    decode_put,
    encode_columns,
    torch_dtypes,
)
from streamrl.dock.errors import WireFormatError
from streamrl.dock.protocol import TensorColumn


def _sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape).to(dtype)


_names = itertools.count()


def _send_recv(frames: list) -> list[zmq.Frame]:
    """Push frames through a real zmq socket pair (copy=False both ways)."""
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    name = f"inproc://codec-test-{next(_names)}"  # fresh name: an unbind completes asynchronously
    try:
        a.bind(name)
        b.connect(name)
        a.send_multipart([b"h", *frames], copy=False)
        assert b.poll(5000)
        return b.recv_multipart(copy=False)[1:]
    finally:
        a.close(0)
        b.close(0)


SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 0, 4), (ZERO_COPY_BYTES // 4 + 3,)]


@pytest.mark.parametrize("dtype", sorted(torch_dtypes().values(), key=str))
def test_every_dtype_and_shape_round_trips_through_zmq(dtype: torch.dtype) -> None:
    if dtype in (getattr(torch, "uint16", None), getattr(torch, "uint32", None), getattr(torch, "uint64", None)):
        values = [torch.zeros(s, dtype=dtype) for s in SHAPES]
    elif "float8" in str(dtype):
        values = [torch.randn(s).to(dtype) for s in SHAPES]
    else:
        values = [_sample(dtype, s) for s in SHAPES]
    cols, frames = encode_columns({"x": values}, len(values))
    out = decode_columns(cols, _send_recv(frames), len(values))["x"]
    for v, o in zip(values, out, strict=True):
        assert o.dtype == v.dtype and o.shape == v.shape
        assert torch.equal(o.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))
    # and through a store that holds them as bytes (the warehouse: RawValue, no torch), unchanged
    stored, _ = decode_put(cols, _send_recv(frames), len(values), raw=True)
    assert all(type(r) is RawValue and r.dtype == cols[0].dtype for r in stored["x"])
    again = decode_columns(*_resend(stored, len(values)), len(values))["x"]
    for v, o in zip(values, again, strict=True):
        assert o.dtype == v.dtype and o.shape == v.shape
        assert torch.equal(o.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))


def _resend(values: dict, n: int) -> tuple[list, list[zmq.Frame]]:
    cols, frames = encode_columns(values, n)
    return cols, _send_recv(frames)


def test_the_wire_itemsizes_are_torchs() -> None:
    """The table a process without torch sizes values by (the warehouse) agrees with torch."""
    assert set(torch_dtypes()) == set(ITEMSIZES)
    for name, dtype in torch_dtypes().items():
        assert dtype.itemsize == ITEMSIZES[name], name


def test_bytes_held_without_torch_go_out_in_the_layout_the_tensors_did() -> None:
    """A warehouse re-sends what it stored (RawValue) with the header and frames the tensors'
    own encoding gives: the same shapes, frame ids, offsets (alignment, own frames for large
    values, empty values at their run's start) and the same bytes, in one message of mixed columns."""
    n = 6
    columns = {
        "ids": [torch.arange(k, dtype=torch.int64) for k in (0, 3, 0, 17, 1, 5)],
        "logp": [torch.randn(k) for k in (2, 0, 9, 1, 4, 3)],
        "big": [torch.randn(ZERO_COPY_BYTES // 4 + k) if k % 2 else torch.randn(k) for k in range(n)],
        "half": [torch.randn(3, k).to(torch.bfloat16) for k in range(n)],
        "meta": [{"k": k} for k in range(n)],
    }
    cols, frames = encode_columns(columns, n)
    stored, _ = decode_put(cols, _send_recv(frames), n, raw=True)
    cols2, frames2 = encode_columns(stored, n)
    assert cols2 == cols
    assert [bytes(f) for f in frames2] == [bytes(f) for f in frames]


def test_ragged_columns_and_objects_in_one_message() -> None:
    ragged = [torch.arange(n, dtype=torch.int64) for n in (0, 1, 5, 33, 2)]
    logp = [torch.randn(n) for n in (0, 1, 5, 33, 2)]
    objs = [{"answer": "7"}, 1.5, "text", [1, 2], None]
    cols, frames = encode_columns({"ids": ragged, "logp": logp, "meta": objs}, 5)
    assert len(frames) == 1  # every small tensor packed into one frame (rule 3)
    out = decode_columns(cols, _send_recv(frames), 5)
    assert [t.tolist() for t in out["ids"]] == [t.tolist() for t in ragged]
    assert all(torch.equal(a, b) for a, b in zip(out["logp"], logp, strict=True))
    assert out["meta"] == objs


def test_each_column_packs_back_to_back_from_an_aligned_start() -> None:
    """Rule 3's layout: a column's small values follow one another with no gap, its first one at a
    multiple of ALIGN (so every offset suits the dtype), and the pack frame is as long as they are."""
    values = [torch.ones(1, dtype=torch.int8), torch.ones(3, dtype=torch.int8)]
    cols, frames = encode_columns({"a": values, "b": [torch.ones(1, dtype=torch.float64)] * 2}, 2)
    a, b = cols
    assert isinstance(a, TensorColumn) and isinstance(b, TensorColumn)
    assert a.offsets == [0, 1]
    assert b.offsets == [ALIGN, ALIGN + 8]
    assert len(frames) == 1 and memoryview(frames[0]).nbytes == ALIGN + 16
    out = decode_columns(cols, _send_recv(frames), 2, exact=True)
    assert [t.tolist() for t in out["a"]] == [[1], [1, 1, 1]] and [t.tolist() for t in out["b"]] == [[1.0]] * 2
    # received values are views of the one frame (rule 4), split in one go
    assert out["a"][1].data_ptr() == out["a"][0].data_ptr() + 1


def test_empty_and_shaped_values_around_the_runs_round_trip() -> None:
    """Empty values, scalars and 2-d values inside a run; empty values before a run's first bytes;
    and a column with nothing but empty values after a run that ends off every alignment: each
    offset stays within the frame and suits its dtype."""
    f64 = torch.float64
    columns = {
        "odd": [torch.ones(3, dtype=torch.int8), torch.zeros(0, dtype=torch.int8)],  # 3 bytes: off every alignment
        "none": [torch.zeros(0, dtype=f64), torch.zeros(2, 0, dtype=f64)],  # no bytes at all
        "lead": [torch.zeros(0, dtype=f64), torch.ones(2, dtype=f64)],  # empty, then the run
    }
    cols, frames = encode_columns(columns, 2)
    by_name = {c.name: c for c in cols if isinstance(c, TensorColumn)}
    assert by_name["lead"].offsets == [ALIGN, ALIGN]  # the empty value sits where the run starts
    assert all(off % 8 == 0 and off <= memoryview(frames[0]).nbytes for off in by_name["none"].offsets)
    out = decode_columns(cols, _send_recv(frames), 2, exact=True)
    for name, values in columns.items():
        assert all(o.shape == v.shape and torch.equal(o, v) for o, v in zip(out[name], values, strict=True))
    shaped = [torch.zeros(0), torch.tensor(5.0), torch.arange(6.0).reshape(2, 3), torch.zeros(0, 3), torch.ones(1)]
    cols, frames = encode_columns({"m": shaped}, 5)
    out = decode_columns(cols, _send_recv(frames), 5, exact=True)
    assert all(o.shape == v.shape and torch.equal(o, v) for o, v in zip(out["m"], shaped, strict=True))


JOINED_COLUMNS = {  # columns one stack or cat joins (codec._encode_small), and ones it leaves
    "scalars": [torch.tensor(float(k)) for k in range(6)],
    "ragged": [torch.arange(n) for n in (3, 0, 1, 7, 0, 2)],
    "leading_empty": [torch.zeros(0, dtype=torch.int8)] + [torch.ones(k + 1, dtype=torch.int8) for k in range(5)],
    "rows": [torch.arange(n * 3, dtype=torch.float64).reshape(n, 3) for n in (1, 2, 0, 1, 4, 2)],
    "strided": [torch.arange(8.0)[::2] for _ in range(6)],  # not contiguous: the join copies
    "transposed": [torch.arange(6, dtype=torch.int32).reshape(2, 3).t() for _ in range(6)],
    "bools": [torch.tensor([True, False, k % 2 == 0]) for k in range(6)],
    # left to the value-by-value layout: mixed ranks, trailing shapes that differ, no bytes at all
    "mixed_ranks": [torch.tensor(1.0), torch.ones(2)] * 3,
    "other_trailing": [torch.ones(2, 1), torch.ones(1, 3)] * 3,
    "all_empty": [torch.zeros(0, dtype=torch.float64)] * 6,
}


def test_joined_columns_are_laid_out_as_value_by_value_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """A small column joined by one stack or cat (no per-value work) makes the same header and the
    same bytes as the value-by-value layout of rules 2 and 3, and decodes to the values sent."""
    import streamrl.dock.codec as codec

    columns = {name: list(values) for name, values in JOINED_COLUMNS.items()}
    joined = encode_columns(columns, 6)
    monkeypatch.setattr(codec, "_encode_small", lambda *args: None)
    by_value = encode_columns(columns, 6)
    assert joined[0] == by_value[0]
    assert [bytes(f) for f in joined[1]] == [bytes(f) for f in by_value[1]]
    out = decode_columns(joined[0], _send_recv(joined[1]), 6, exact=True)
    for name, values in columns.items():
        assert all(o.shape == v.shape and o.dtype == v.dtype and torch.equal(o, v)
                   for o, v in zip(out[name], values, strict=True)), name


def test_received_scalars_and_rows_are_views_of_the_frame() -> None:
    """A column of scalars comes back as 0-d views (one unbind) and one of 1-d values as views (one
    split), each into the received frame (rule 4): nothing is copied on the way in."""
    cols, frames = encode_columns({"s": [torch.tensor(k, dtype=torch.int64) for k in range(4)],
                                   "r": [torch.arange(k + 1) for k in range(4)]}, 4)
    out = decode_columns(cols, _send_recv(frames), 4, exact=True)
    assert [v.shape for v in out["s"]] == [torch.Size([])] * 4 and [v.item() for v in out["s"]] == [0, 1, 2, 3]
    assert [v.tolist() for v in out["r"]] == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3]]
    base = out["s"][0].data_ptr()
    assert [v.data_ptr() - base for v in out["s"]] == [0, 8, 16, 24]
    assert out["r"][1].data_ptr() == out["r"][0].data_ptr() + 8


def test_the_protocol_pages_layout_example_is_what_the_encoder_makes() -> None:
    """docs/dock-protocol.md §5.2's worked example, value for value."""
    cols, frames = encode_columns({
        "a": [torch.tensor(1.0), torch.zeros(0), torch.ones(3)],
        "b": [torch.zeros(20000), torch.ones(3), torch.ones(2, 1)],
    }, 3)
    assert cols == [TensorColumn("a", "float32", [[], [0], [3]], [0, 0, 0], [0, 4, 4]),
                    TensorColumn("b", "float32", [[20000], [3], [2, 1]], [1, 0, 0], [0, 16, 28])]
    assert [memoryview(f).nbytes for f in frames] == [36, 80000]


def test_values_each_at_their_own_aligned_offset_still_decode() -> None:
    """A receiver takes any layout that passes the checks (docs/dock-protocol.md §5.2): here the
    one-value-per-16-bytes layout of earlier streamrl encoders, and values out of order."""
    pack = torch.zeros(48, dtype=torch.uint8)
    pack[0:4] = torch.tensor([1.0]).view(torch.uint8)
    pack[16:28] = torch.tensor([2.0, 3.0, 4.0]).view(torch.uint8)
    pack[32:40] = torch.tensor([5.0, 6.0]).view(torch.uint8)
    frame = bytes(pack.numpy())[:40]
    spaced = TensorColumn("x", "float32", [[1], [3], [2, 1]], [0, 0, 0], [0, 16, 32])
    out = decode_columns([spaced], [frame], 3, exact=True)
    assert [t.flatten().tolist() for t in out["x"]] == [[1.0], [2.0, 3.0, 4.0], [5.0, 6.0]]
    backwards = TensorColumn("x", "float32", [[2, 1], [3], [1]], [0, 0, 0], [32, 16, 0])
    out = decode_columns([backwards], [frame], 3, exact=True)
    assert [t.flatten().tolist() for t in out["x"]] == [[5.0, 6.0], [2.0, 3.0, 4.0], [1.0]]


def test_large_tensor_is_sent_without_copy_and_pins_its_storage() -> None:
    """Rule 1: the frame is a view of the tensor's memory, and holds the tensor alive."""
    t = torch.arange(ZERO_COPY_BYTES, dtype=torch.float32)
    cols, frames = encode_columns({"x": [t]}, 1)
    view = frames[0]
    assert isinstance(view, memoryview)
    assert torch.frombuffer(view, dtype=torch.uint8).data_ptr() == t.data_ptr()  # no copy
    expected = t.clone()
    del t
    gc.collect()
    _ = torch.randn(ZERO_COPY_BYTES)  # would reuse freed memory if the view did not pin it
    out = decode_columns(cols, _send_recv(frames), 1)["x"][0]
    assert torch.equal(out, expected)


def test_non_contiguous_tensor_is_copied_before_sending() -> None:
    """Rule 2: a transposed tensor arrives with its logical values."""
    t = torch.arange(ZERO_COPY_BYTES // 2, dtype=torch.float32).reshape(256, -1).t()
    cols, frames = encode_columns({"x": [t]}, 1)
    out = decode_columns(cols, _send_recv(frames), 1)["x"][0]
    assert torch.equal(out, t)


def test_received_tensor_keeps_its_frame_alive() -> None:
    """Rule 4: dropping every zmq object leaves the decoded tensor valid."""
    t = torch.randn(ZERO_COPY_BYTES)
    cols, frames = encode_columns({"x": [t]}, 1)
    received = _send_recv(frames)
    out = decode_columns(cols, received, 1)["x"][0]
    del received, frames
    gc.collect()
    junk = [torch.randn(ZERO_COPY_BYTES) for _ in range(4)]
    assert torch.equal(out, t)
    del junk


def test_misaligned_frame_is_copied_not_misread() -> None:
    """Rule 5: a frame whose data start is not aligned for the dtype is copied once."""
    payload = torch.arange(4, dtype=torch.float64)
    raw = bytearray(1) + bytearray(payload.numpy().tobytes())
    misaligned = memoryview(raw)[1:]  # address = aligned + 1
    col = TensorColumn("x", "float64", [[4]], [0], [0])
    out = decode_columns([col], [misaligned], 1)["x"][0]
    assert torch.equal(out, payload)


@pytest.mark.parametrize(
    "col",
    [
        TensorColumn("x", "float32", [[10]], [0], [0]),  # more bytes than the frame has
        TensorColumn("x", "float32", [[1]], [3], [0]),  # frame index out of range
        TensorColumn("x", "nonsense", [[1]], [0], [0]),  # unknown dtype
        TensorColumn("x", "float32", [[-1]], [0], [0]),  # negative dimension
        TensorColumn("x", "float32", [[1]], [0], [2]),  # misaligned offset
        TensorColumn("x", "float32", [[1], [1]], [0], [0]),  # lists of different lengths
    ],
)
def test_bad_column_headers_raise_wire_format_error(col: TensorColumn) -> None:
    with pytest.raises(WireFormatError):
        decode_columns([col], [b"\x00" * 16], 1)


@pytest.mark.parametrize(
    "col",
    [
        TensorColumn("x", "float32", [[], [-1, 0]], [0, 0], [0, 4]),  # negative dimension after a scalar
        TensorColumn("x", "float32", [[2], [3]], [0, 0], [0, 8]),  # back to back, but past the frame's end
        TensorColumn("x", "float32", [[1], [1]], [0, 0], [-4, 0]),  # back to back from a negative offset
        TensorColumn("x", "float32", [[1], [1]], [0, 0], [2, 6]),  # back to back from a misaligned offset
        TensorColumn("x", "float32", [[1], [1]], [1, 1], [0, 4]),  # back to back in a frame that is not there
    ],
)
def test_bad_runs_of_values_raise_wire_format_error(col: TensorColumn) -> None:
    """The one-span check of values packed back to back refuses what the value-by-value one does."""
    with pytest.raises(WireFormatError):
        decode_columns([col], [b"\x00" * 16], 2)


def test_encode_rejects_mixed_columns() -> None:
    with pytest.raises(ValueError, match="mixes dtypes"):
        encode_columns({"x": [torch.zeros(1), torch.zeros(1, dtype=torch.int64)]}, 2)
    with pytest.raises(ValueError, match="mixes tensors"):
        encode_columns({"x": [torch.zeros(1), 3]}, 2)
    with pytest.raises(ValueError, match="2 values for 3"):
        encode_columns({"x": [1, 2]}, 3)


def test_exact_frames_refuse_excess_and_unreferenced_bytes_and_report_users() -> None:
    from streamrl.dock.codec import decode_put

    values = [torch.zeros(4), torch.zeros(3), torch.zeros(ZERO_COPY_BYTES // 4)]  # packed, packed, own frame
    cols, frames = encode_columns({"x": values}, 3)
    received = _send_recv(frames)
    out, held = decode_put(cols, received, 3)
    assert [t.numel() for t in out["x"]] == [4, 3, ZERO_COPY_BYTES // 4]
    assert sorted((nbytes, sorted(users)) for nbytes, users in held) == [(28, [0, 1]), (ZERO_COPY_BYTES, [2])]
    assert isinstance(cols[0], TensorColumn)
    pack = bytes(received[cols[0].frames[0]].buffer)
    col = TensorColumn("x", "float32", [[4]], [0], [0])
    decode_columns([col], [pack[:16]], 1, exact=True)  # exactly the value
    decode_columns([col], [pack[:16]], 1)  # and without exact
    with pytest.raises(WireFormatError, match="at most 16"):
        decode_columns([col], [b"\0" * 17], 1, exact=True)
    decode_columns([col], [b"\0" * 17], 1)  # the lenient mode (policy channel) still takes it
    with pytest.raises(WireFormatError, match="referenced by no value"):
        decode_columns([col], [b"\0" * 16, b"\0" * 16], 1, exact=True)
    u8 = TensorColumn("b", "uint8", [[3]], [0], [0])
    decode_columns([u8], [b"\0" * 16], 1, exact=True)  # 3 bytes + 13 of alignment padding: allowed
