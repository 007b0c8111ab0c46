"""The policy file format (streamrl.runtime.policy_file): a reply's layout is checked against the
file before anything is mapped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from streamrl.runtime.policy_file import (
    ALIGN,
    PolicyFileError,
    WeightSlot,
    file_name,
    map_snapshot,
    new_token,
    write_snapshot,
)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(7, 5, generator=g),
        "t": torch.randn(5, 3, generator=g).t(),  # non-contiguous: lands contiguous
        "h": torch.randn(3, generator=g).to(torch.bfloat16),
        "steps": torch.tensor([3, 4]),
        "flag": torch.tensor(True),
        "empty": torch.zeros(0, 4),
    }


@pytest.fixture
def written(tmp_path: Path) -> tuple[Path, str, int, list[WeightSlot]]:
    name = file_name(new_token(), 7)
    size, slots, _, _ = write_snapshot(tmp_path, name, _state())
    return tmp_path, name, size, slots


def test_a_snapshot_maps_back_bitwise_with_every_tensor_aligned(written: tuple[Path, str, int, list[WeightSlot]]
                                                                ) -> None:
    directory, name, size, slots = written
    got = map_snapshot(directory, name, size, slots)
    want = _state()
    assert list(got) == list(want)
    for key, t in want.items():
        assert got[key].dtype == t.dtype and got[key].shape == t.shape, key
        assert torch.equal(got[key], t), key
    assert all(s.offset % ALIGN == 0 for s in slots)
    assert (directory / name).stat().st_size == size


def test_the_writer_refuses_to_overwrite_an_existing_file(written: tuple[Path, str, int, list[WeightSlot]]) -> None:
    directory, name, _, _ = written
    with pytest.raises(FileExistsError):
        write_snapshot(directory, name, _state())


@pytest.mark.parametrize(("change", "message"), [
    (lambda n, sz, sl: ("../" + n, sz, sl), "not a policy file's name"),
    (lambda n, sz, sl: ("/etc/passwd", sz, sl), "not a policy file's name"),
    (lambda n, sz, sl: (n.replace("-v7", "-v8"), sz, sl), "cannot open policy file"),
    (lambda n, sz, sl: (n, sz + ALIGN, sl), "has .* bytes, the reply says"),
    (lambda n, sz, sl: (n, sz, [*sl[:-1], WeightSlot("empty", "float32", [1 << 40], 0)]), "ends past the file"),
    (lambda n, sz, sl: (n, sz, [WeightSlot("w", "float32", [2], 4)]), "is not a valid slot"),
    (lambda n, sz, sl: (n, sz, [WeightSlot("w", "float32", [-2], 0)]), "is not a valid slot"),
    (lambda n, sz, sl: (n, sz, [WeightSlot("w", "object", [2], 0)]), "unknown dtype"),
    (lambda n, sz, sl: (n, sz, [sl[0], sl[0]]), "appears twice"),
])
def test_a_layout_that_does_not_fit_the_file_is_refused(written: tuple[Path, str, int, list[WeightSlot]],
                                                         change: object, message: str) -> None:
    directory, name, size, slots = written
    args = change(name, size, slots)  # type: ignore[operator]
    with pytest.raises(PolicyFileError, match=message):
        map_snapshot(directory, *args)
