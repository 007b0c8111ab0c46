"""A policy publisher serving for the length of a test (tests/runtime/test_policy*.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio

from streamrl.runtime.policy import PolicyPublisher


@asynccontextmanager
async def served(pub: PolicyPublisher) -> AsyncIterator[PolicyPublisher]:
    """``pub`` answering requests in a background task; closed (its files removed) at the end."""
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pub.serve)
            yield pub
            tg.cancel_scope.cancel()
    finally:
        pub.close()
