from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from streamrl.runtime.policy import PolicyPublisher
from tests.runtime.policy_serving import served

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def importable_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker processes import ``tests.runtime.user_stages`` by name, like any user module on the path."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))


@pytest.fixture
async def file_publisher(tmp_path: Path) -> AsyncIterator[PolicyPublisher]:
    """A policy publisher with a shared-memory directory (``tmp_path/shm``), serving."""
    async with served(PolicyPublisher(f"ipc://{tmp_path}/weights", shm_dir=tmp_path / "shm")) as pub:
        yield pub
