"""The fast version of ops/fuzz/servers.py: every server survives 2,000 hostile frames and still
answers a normal request correctly, refuses a frame that declares 1 TiB, and keeps its memory.

The full run (100,000 frames per socket) is ``python ops/fuzz/servers.py``; docs/reliability.md
records its figures.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ops.fuzz.servers import ALL_TARGETS, Target, fuzz, targets

FRAMES = 2_000
SECONDS = 60.0  # per socket; 2,000 frames take about a second here
RSS_GROWTH_MIB = 64.0  # resident memory may grow this much at most (allocator slack, caches)


@pytest.fixture(scope="module")
def started() -> Iterator[dict[str, Target]]:
    with targets(list(ALL_TARGETS)) as ts:
        yield {t.name: t for t in ts}


@pytest.mark.parametrize("name", ALL_TARGETS)
def test_server_survives_fuzzing(started: dict[str, Target], name: str) -> None:
    res = fuzz(started[name], FRAMES, SECONDS, seed=1234 + ALL_TARGETS.index(name))
    assert res["check_before"] == "ok", res
    assert res["frames"] == FRAMES, f"only {res['frames']} frames went out in {SECONDS} s: {res}"
    assert res["alive"], f"{name} died; the frames before it are in {res['crash_frames']}"
    assert res["all_processed"], f"{name} stopped answering on a connection it had been fuzzed on: {res}"
    assert res["check_after"] == "ok", res
    assert res["oversized_frames_refused"] == "3/3", f"{name} kept a connection declaring a 1 TiB frame: {res}"
    rss = res["rss_mib"]
    assert rss["after"] - rss["before"] < RSS_GROWTH_MIB, f"{name} memory grew: {rss}"
