"""StageContext's calls into compute: run_brief runs a brief local call on the event loop, a long
one in the compute thread, and decides from each call's own time."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from streamrl.config import load_config
from streamrl.runtime.pipeline import StageSpec
from streamrl.runtime.stage import BRIEF_CALL_S, StageContext

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


def _context(tmp_path: Path) -> StageContext:
    spec = StageSpec(name="s", cls="tests.runtime.user_stages:Doubler", reads=["x"], writes=["y"])
    # no policy, control or dock: run_brief touches none of them
    none: Any = None
    return StageContext(config=load_config({}), spec=spec, worker=0, run_dir=tmp_path, device="cpu",
                        policy=none, control=none, weights_endpoint="")


class _Work:
    """A call that takes ``seconds`` and notes the thread it ran on."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.threads: list[int] = []

    def __call__(self, value: int) -> int:
        self.threads.append(threading.get_ident())
        if self.seconds:
            time.sleep(self.seconds)
        return 2 * value

    def fail(self) -> None:
        self.threads.append(threading.get_ident())
        raise ValueError("refused")


async def test_a_brief_call_moves_to_the_event_loop_and_a_long_one_back_to_the_thread(tmp_path: Path) -> None:
    ctx, work = _context(tmp_path), _Work()
    loop_thread = threading.get_ident()
    assert await ctx.run_brief(work, 1) == 2  # the first call: in the compute thread, timed there
    assert work.threads[-1] != loop_thread and ctx.brief_calls[work] < BRIEF_CALL_S
    assert await ctx.run_brief(work, 2) == 4  # brief: here
    assert work.threads[-1] == loop_thread
    work.seconds = 3 * BRIEF_CALL_S  # it grew: this call still runs here (decided before it ran) ...
    assert await ctx.run_brief(work, 3) == 6
    assert work.threads[-1] == loop_thread and ctx.brief_calls[work] >= BRIEF_CALL_S
    assert await ctx.run_brief(work, 4) == 8  # ... and the next one goes to the thread
    assert work.threads[-1] != loop_thread
    work.seconds = 0.0
    await ctx.run_brief(work, 5)  # brief again (timed in the thread): back here after it
    await ctx.run_brief(work, 6)
    assert work.threads[-1] == loop_thread


async def test_a_call_that_is_not_local_always_runs_in_the_thread(tmp_path: Path) -> None:
    """``local=False`` (a collective, an RPC): never on the event loop, however brief."""
    ctx, work = _context(tmp_path), _Work()
    loop_thread = threading.get_ident()
    for value in range(3):
        assert await ctx.run_brief(work, value, local=False) == 2 * value
    assert loop_thread not in work.threads and ctx.brief_calls[work] < BRIEF_CALL_S


async def test_a_failing_brief_call_raises_where_it_runs_and_keeps_its_record(tmp_path: Path) -> None:
    ctx, work = _context(tmp_path), _Work()
    for _ in range(2):  # the thread, then the event loop
        with pytest.raises(ValueError, match="refused"):
            await ctx.run_brief(work.fail)
    assert work.threads[0] != work.threads[1] == threading.get_ident()
    assert ctx.brief_calls[work.fail] < BRIEF_CALL_S
