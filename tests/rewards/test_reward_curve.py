"""CURVE: key generation, an allow-listed client works, every other client is refused."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import anyio
import anyio.abc
import pytest

from streamrl.rewards import RewardClient, RewardConfigError, RewardSample, RewardServersUnavailableError
from tests.rewards.conftest import Servers

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]
LENGTH = "tests.rewards.reward_test_functions:length"


def keys_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "streamrl.rewards.cli", "keys", *args],
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.fixture
def key_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "keys"
    done = keys_cli("generate", str(folder))
    assert done.returncode == 0, done.stderr
    assert keys_cli("generate", str(folder), "--name", "intruder").returncode == 0
    return folder


def test_keys_generate_writes_pairs_and_protects_secrets(key_dir: Path) -> None:
    names = sorted(p.name for p in key_dir.iterdir())
    assert names == [f"{n}.{ext}" for n in ("client", "intruder", "server") for ext in ("key", "key_secret")]
    for secret in key_dir.glob("*.key_secret"):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
        assert "secret-key" in secret.read_text()
    assert "secret-key" not in (key_dir / "server.key").read_text()
    again = keys_cli("generate", str(key_dir))
    assert again.returncode == 2 and "already exist" in again.stderr and "--force" in again.stderr


async def test_allow_listed_client_works_and_others_are_refused(servers: Servers, key_dir: Path) -> None:
    server = servers.reward_server(
        LENGTH,
        "--curve-secret-key",
        str(key_dir / "server.key_secret"),
        "--curve-allow",
        str(key_dir / "client.key"),
        bind="tcp://0.0.0.0:0",
    )
    assert "WITHOUT CURVE" not in server.stderr()
    endpoint = server.endpoint.replace("0.0.0.0", "127.0.0.1")
    samples = [RewardSample(id=i, response="z" * i) for i in range(4)]
    async with RewardClient(
        [endpoint],
        curve_client_secret_key=key_dir / "client.key_secret",
        curve_server_public_key=key_dir / "server.key",
    ) as client:
        with anyio.fail_after(10):
            assert [r.score for r in await client.score(samples)] == [0.0, 1.0, 2.0, 3.0]

    async with RewardClient(
        [endpoint],
        curve_client_secret_key=key_dir / "intruder.key_secret",
        curve_server_public_key=key_dir / "server.key",
        no_server_timeout_s=1.0,
    ) as intruder:
        with (
            anyio.fail_after(10),
            pytest.raises(RewardServersUnavailableError, match="CURVE authentication refused"),
        ):
            await intruder.score(samples)

    async with RewardClient([endpoint], no_server_timeout_s=1.0) as plaintext:
        with anyio.fail_after(10), pytest.raises(RewardServersUnavailableError, match="handshake failed"):
            await plaintext.score(samples)

    assert "refused a CURVE client" in server.stderr()
    intruder_key = (key_dir / "intruder.key").read_text().split('public-key = "')[1].split('"')[0]
    assert intruder_key in server.stderr()


def test_client_curve_config_errors_are_actionable(key_dir: Path) -> None:
    with pytest.raises(RewardConfigError, match="needs this client's key pair"):
        RewardClient(["tcp://127.0.0.1:1"], curve_server_public_key=key_dir / "server.key")
    with pytest.raises(RewardConfigError, match="no CURVE server public key"):
        RewardClient(["tcp://127.0.0.1:1"], curve_client_secret_key=key_dir / "client.key_secret")
    with pytest.raises(RewardConfigError, match="holds only a public key"):
        RewardClient(
            ["tcp://127.0.0.1:1"],
            curve_client_secret_key=key_dir / "client.key",
            curve_server_public_key=key_dir / "server.key",
        )
    with pytest.raises(RewardConfigError, match="cannot read CURVE key file"):
        RewardClient(
            ["tcp://127.0.0.1:1"],
            curve_client_secret_key=key_dir / "missing.key_secret",
            curve_server_public_key=key_dir / "server.key",
        )


class TappedRelay:
    """A TCP relay between client and server that records every byte it forwards (a wiretap)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.seen = bytearray()

    async def serve(self, listener: anyio.abc.SocketListener) -> None:
        async with listener:
            await listener.serve(self._relay)

    async def _relay(self, client: anyio.abc.SocketStream) -> None:
        async with client, await anyio.connect_tcp("127.0.0.1", self.target_port) as server:

            async def pump(source: anyio.abc.SocketStream, sink: anyio.abc.SocketStream) -> None:
                try:
                    async for chunk in source:
                        self.seen += chunk
                        await sink.send(chunk)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    pass

            async with anyio.create_task_group() as group:
                group.start_soon(pump, client, server)
                await pump(server, client)
                group.cancel_scope.cancel()


@pytest.mark.parametrize("curve", [True, False])
async def test_traffic_is_encrypted_with_curve(servers: Servers, key_dir: Path, curve: bool) -> None:
    curve_args = [
        "--curve-secret-key",
        str(key_dir / "server.key_secret"),
        "--curve-allow",
        str(key_dir / "client.key"),
    ]
    server = servers.reward_server(LENGTH, *(curve_args if curve else []))
    relay = TappedRelay(int(server.endpoint.rsplit(":", 1)[1]))
    curve_options = (
        {
            "curve_client_secret_key": key_dir / "client.key_secret",
            "curve_server_public_key": key_dir / "server.key",
        }
        if curve
        else {}
    )
    marker = "the-secret-prompt-4711"
    async with anyio.create_task_group() as group:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        group.start_soon(relay.serve, listener)
        async with RewardClient([f"tcp://127.0.0.1:{port}"], **curve_options) as client:  # type: ignore[arg-type]
            with anyio.fail_after(10):
                [result] = await client.score([RewardSample(id=1, prompt=marker, response=marker)])
        group.cancel_scope.cancel()
    assert result.score == float(len(marker))
    assert (marker.encode() in relay.seen) is not curve
