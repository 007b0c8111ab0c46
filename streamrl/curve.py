"""CURVE for the sockets of a run that reach beyond this host.

A run that spans machines (``resources.launch: ray``) binds its dock, control and policy sockets
on a routable address. The launcher then makes one :class:`RunKeys` for the run: a server key
pair (every server socket of the run uses it) and a client key pair (every connecting socket uses
it). The keys reach the run's own processes only (the worker spec, the dock servers'
environment), never argv or a log. A server socket refuses, through a ZAP handler on its
context, every CURVE client whose public key is not the run's: a process without the run's keys
completes no handshake, so it can neither send a message nor read one (tested in
``tests/test_curve.py`` and per channel).

Loopback runs (``processes``, ``inprocess``) bind ipc or 127.0.0.1 and need none of this.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable

import msgspec
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger(__name__)

CURVE_ENV = "STREAMRL_CURVE_KEYS"  # a server process's run keys (JSON), from the environment, never argv


class CurveAllowList:
    """A ZAP handler for a context: CURVE clients whose public key is not allowed are refused.

    ``allowed_keys=None`` accepts any client that completes the CURVE handshake (traffic is still
    encrypted, but anyone who knows the server's public key may connect). Start it before binding.
    """

    def __init__(self, context: zmq.Context, allowed_keys: Iterable[bytes] | None) -> None:
        self._allowed = None if allowed_keys is None else frozenset(allowed_keys)
        # ZAP requests travel on inproc:// inside the libzmq context: a sync shadow of an asyncio
        # context reaches the same handler endpoint, and the handler thread needs blocking sockets
        sync = context if type(context) is zmq.Context else zmq.Context.shadow(context.underlying)
        self._authenticator = ThreadAuthenticator(sync, log=logging.getLogger(__name__ + ".zap"))
        self._lock = threading.Lock()
        self.accepted = 0
        self.refused = 0

    def start(self) -> None:
        self._authenticator.start()
        if self._allowed is None:
            self._authenticator.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
        else:
            self._authenticator.configure_curve_callback(domain="*", credentials_provider=self)

    def callback(self, domain: str, client_key: bytes) -> bool:
        """Called by the ZAP thread for each CURVE handshake with the client's z85 public key."""
        allowed = self._allowed is not None and client_key in self._allowed
        with self._lock:
            if allowed:
                self.accepted += 1
            else:
                self.refused += 1
        if not allowed:
            log.warning("refused a CURVE client whose public key %s is not on the allow-list", client_key.decode())
        return allowed

    def stop(self) -> None:
        self._authenticator.stop()


class RunKeys(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One run's CURVE keys, z85 text (40 characters each)."""

    server_public: str
    server_secret: str
    client_public: str
    client_secret: str

    @classmethod
    def generate(cls) -> RunKeys:
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public.decode(), server_secret.decode(), client_public.decode(), client_secret.decode())

    def __post_init__(self) -> None:
        for name in ("server_public", "server_secret", "client_public", "client_secret"):
            if len(getattr(self, name)) != 40:
                raise ValueError(f"RunKeys.{name} must be a 40-character z85 CURVE key")

    def __repr__(self) -> str:  # never print a secret key into a log
        return f"RunKeys(server_public={self.server_public!r}, client_public={self.client_public!r})"

    def to_env(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> RunKeys | None:
        """The keys a launcher put in ``STREAMRL_CURVE_KEYS``, or None when it put none."""
        text = (os.environ if environ is None else environ).get(CURVE_ENV, "")
        return msgspec.json.decode(text, type=cls) if text else None


# One ZAP handler per libzmq context (a second bind of its inproc endpoint would fail): every
# server socket of one context in this process shares it. Keyed by the context's address.
_handlers: dict[int, tuple[CurveAllowList, str]] = {}
_handlers_lock = threading.Lock()


def _allow_run_clients(context: zmq.Context, keys: RunKeys) -> CurveAllowList:
    with _handlers_lock:
        found = _handlers.get(context.underlying)
        if found is not None:
            handler, client_public = found
            if client_public != keys.client_public:
                raise ValueError("one zmq context cannot serve two runs' CURVE keys")
            return handler
        handler = CurveAllowList(context, [keys.client_public.encode()])
        handler.start()
        _handlers[context.underlying] = (handler, keys.client_public)
        return handler


def secure_server(sock: zmq.Socket, keys: RunKeys | None) -> CurveAllowList | None:
    """Make ``sock`` a CURVE server that admits only the run's clients; call before ``bind``.

    ``keys=None`` leaves the socket plaintext (loopback runs). Returns the context's allow-list
    handler (its ``refused`` counter shows strangers turned away)."""
    if keys is None:
        return None
    handler = _allow_run_clients(sock.context, keys)
    sock.curve_secretkey = keys.server_secret.encode()
    sock.curve_publickey = keys.server_public.encode()
    sock.curve_server = True
    return handler


def secure_client(sock: zmq.Socket, keys: RunKeys | None) -> None:
    """Make ``sock`` a CURVE client of the run's servers; call before ``connect``."""
    if keys is None:
        return
    sock.curve_secretkey = keys.client_secret.encode()
    sock.curve_publickey = keys.client_public.encode()
    sock.curve_serverkey = keys.server_public.encode()


def release_context(context: zmq.Context) -> None:
    """Stop the ZAP handler of ``context``, if it has one: call before terminating a context of
    your own (its handler's sockets would keep ``term()`` waiting)."""
    with _handlers_lock:
        found = _handlers.pop(context.underlying, None)
    if found is not None:
        found[0].stop()
