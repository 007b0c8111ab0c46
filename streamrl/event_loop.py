"""How streamrl's processes run their event loop: anyio's asyncio backend, on uvloop where it is
installed (a dependency on Linux and macOS).

Why: every stage worker, the launcher and a reward server spend most of their own CPU in the event
loop's per-message work (a ZeroMQ socket's readiness, a task woken, a timer), a few hundred
messages a second in a small model's run. uvloop does that work in C: in W1's run at
``max_staleness: 1`` every process around the compute used about 3 % less CPU a step
(docs/benchmarks.md §31). Where uvloop is missing (Windows, a bare environment), the standard
loop runs instead, the same code.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

T = TypeVar("T")


def backend_options() -> dict[str, Any]:
    """anyio's asyncio backend options: ``use_uvloop`` where uvloop imports."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return {}
    return {"use_uvloop": True}


def run(func: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``anyio.run(func, *args)`` on the loop of :func:`backend_options`."""
    return anyio.run(func, *args, backend="asyncio", backend_options=backend_options())
