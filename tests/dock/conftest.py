from __future__ import annotations

from collections.abc import Iterator

import pytest

from streamrl.dock.launch import LocalDock


@pytest.fixture
def dock() -> Iterator[LocalDock]:
    with LocalDock(["gen", "train"], capacity=256, n_warehouses=2) as d:
        yield d
