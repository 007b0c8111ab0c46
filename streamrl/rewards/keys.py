"""CURVE keys for reward servers and clients, and the ZAP allow-list that refuses unknown clients.

Key files are ZeroMQ's standard certificate format (the one CZMQ and pyzmq's ``zmq.auth`` use):
``NAME.key`` holds the public key (safe to copy anywhere), ``NAME.key_secret`` the public and secret
key (mode 0600, keep it on the machine that owns it). A server in another language can read them.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from urllib.parse import urlsplit

import zmq
import zmq.auth

from streamrl.rewards.results import RewardConfigError

PathLike = str | os.PathLike[str]


def generate_keypair(directory: PathLike, name: str, *, overwrite: bool = False) -> tuple[Path, Path]:
    """Write ``DIR/NAME.key`` and ``DIR/NAME.key_secret`` (0600); return (public, secret) paths."""
    if not name or "/" in name or name.startswith("."):
        raise RewardConfigError(f"key name {name!r} must be a plain file name such as 'server' or 'client'")
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    public_path, secret_path = folder / f"{name}.key", folder / f"{name}.key_secret"
    existing = [str(p) for p in (public_path, secret_path) if p.exists()]
    if existing and not overwrite:
        raise RewardConfigError(
            f"{', '.join(existing)} already exist; refusing to replace keys that servers may trust "
            "(delete them first, or pass --force)"
        )
    # Create the secret file 0600 before any key is written into it, so it is never world-readable.
    secret_path.unlink(missing_ok=True)
    os.close(os.open(secret_path, os.O_CREAT | os.O_WRONLY, 0o600))
    public_file, secret_file = zmq.auth.create_certificates(str(folder), name)
    os.chmod(secret_file, 0o600)
    return Path(public_file), Path(secret_file)


def load_keypair(secret_file: PathLike) -> tuple[bytes, bytes]:
    """(public, secret) z85 keys from a ``.key_secret`` file."""
    public, secret = _load(secret_file)
    if secret is None:
        raise RewardConfigError(
            f"{secret_file} holds only a public key; pass the matching '.key_secret' file here"
        )
    return public, secret


def load_public_key(public_file: PathLike) -> bytes:
    """The z85 public key from a ``.key`` (or ``.key_secret``) file."""
    return _load(public_file)[0]


def load_public_keys(paths: Iterable[PathLike]) -> set[bytes]:
    """Public keys from files and/or directories (every ``*.key`` file in a directory)."""
    keys: set[bytes] = set()
    for path in map(Path, paths):
        if path.is_dir():
            files = sorted(path.glob("*.key"))
            if not files:
                raise RewardConfigError(f"allow-list directory {path} contains no '*.key' public key files")
            keys.update(load_public_key(f) for f in files)
        else:
            keys.add(load_public_key(path))
    return keys


def _load(path: PathLike) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise RewardConfigError(
            f"cannot read CURVE key file {path}: {exc}. Create keys with `streamrl keys generate DIR`"
        ) from exc
    if len(public) != 40 or (secret is not None and len(secret) != 40):
        raise RewardConfigError(f"{path} does not hold 40-character z85 CURVE keys")
    return public, secret


def configure_server_socket(socket: zmq.Socket, secret_file: PathLike) -> None:
    """Make ``socket`` a CURVE server (encrypts all traffic); call before bind."""
    public, secret = load_keypair(secret_file)
    socket.curve_secretkey = secret
    socket.curve_publickey = public
    socket.curve_server = True


def configure_client_socket(socket: zmq.Socket, secret_file: PathLike, server_public_file: PathLike) -> None:
    """Make ``socket`` a CURVE client of the server whose public key is in ``server_public_file``."""
    public, secret = load_keypair(secret_file)
    socket.curve_secretkey = secret
    socket.curve_publickey = public
    socket.curve_serverkey = load_public_key(server_public_file)


def is_loopback_endpoint(endpoint: str) -> bool:
    """True for ipc://, inproc:// and tcp:// on a loopback address: traffic that stays on this host."""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = urlsplit(f"//{rest}").hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # an interface name or DNS name: assume it reaches beyond this host
        return False


def plaintext_warning(endpoints: Sequence[str], role: str) -> str | None:
    """The loud warning for plaintext sockets that reach beyond this host, or None."""
    exposed = [e for e in endpoints if not is_loopback_endpoint(e)]
    if not exposed:
        return None
    bar = "!" * 78
    return (
        f"{bar}\nWARNING: reward {role} on {', '.join(exposed)} WITHOUT CURVE: traffic is unencrypted and "
        "any host that can reach it may connect.\nCreate keys with `streamrl keys generate DIR` and pass "
        "--curve-secret-key / --curve-allow (server) or the client's curve_* options.\n" + bar
    )
