"""A server written from docs/reward-protocol.md with only pyzmq + msgpack works with RewardClient."""

from __future__ import annotations

import ast
import signal

import anyio
import pytest

from streamrl.rewards import RewardClient, RewardSample
from tests.rewards.conftest import MINIMAL_SERVER, Servers

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


def test_minimal_server_imports_nothing_from_streamrl() -> None:
    tree = ast.parse(MINIMAL_SERVER.read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported == {"argparse", "signal", "sys", "msgpack", "zmq"}


async def test_streamrl_client_scores_on_the_minimal_server(servers: Servers) -> None:
    server = servers.script(MINIMAL_SERVER, "--bind", "tcp://127.0.0.1:0")
    samples = [
        RewardSample(id=1, prompt="2+2?", response="4", metadata={"answer": 4}),
        RewardSample(id=2, prompt="2+2?", response="5", metadata={"answer": "4"}),
        RewardSample(id=3, prompt="say hi", response="<answer>hi", prompt_ids=[1, 2], response_ids=[3]),
        RewardSample(id=4, prompt="empty", response_ids=[3]),
    ]
    async with RewardClient([server.endpoint], on_sample_error="keep", heartbeat_interval_s=0.05) as client:
        with anyio.fail_after(10):
            results = await client.score(samples)
            await anyio.sleep(0.3)  # several heartbeats answered by the minimal server
        stats = client.statistics()
    assert [r.score for r in results] == [1.0, 0.0, {"length": 10.0, "has_answer_tag": 1.0}, None]
    assert results[3].error == "ValueError: sample has no response text"
    assert stats.servers[0].state == "up" and stats.servers[0].last_error is None
    server.signal(signal.SIGTERM)
    assert server.wait() == 0
