"""Authentication (and, where asked, encryption) on every ZeroMQ socket of a run.

Every launch mode (``processes``, ``inprocess``, ``ray``) makes one :class:`RunCredentials` per
run: nothing that lacks them completes a handshake with any of the run's server sockets (dock
controller and warehouses, the launcher's control socket, the trainer's policy channel), so a
stranger on the same host can neither claim, ack, write nor read a sample, nor fetch weights.

Two mechanisms (``resources.encryption``):

- ``plain`` — authentication without encryption: ZAP PLAIN, username = the role, password = a
  per-role secret. For links that are trusted anyway (loopback, ipc: ``processes`` and
  ``inprocess`` runs), where encryption would cost bandwidth for nothing. The password crosses
  the link in clear, which is why it is only the default where the link never leaves the host.
- ``curve`` — CURVE: every connection encrypted and authenticated (``ray``'s default). Each role
  has its own key pair; the server knows each role's public key.

Roles are the contract authorization builds on: every client authenticates as one role, and on
every server socket the ZAP User-Id of a connection (:func:`peer_role` of a frame received with
``copy=False``) is that role's string — ``launcher`` (the launcher, its status page),
``dock`` (controller <-> warehouse links) and ``stage:<stage name>`` (every worker of that stage).

Who holds what: a worker gets only its own role's :class:`ClientAuth` (a colocated process one
per stage it hosts); a server gets a :class:`ServerAuth`, which verifies every role without
holding any role's secret: PLAIN servers keep SHA-256 digests of the passwords, CURVE servers the
public keys. Credentials reach processes only through the 0600 spec files and the environment,
never argv or a log (``__repr__`` hides every secret).

A ZAP handler answers for a whole libzmq context: one :class:`RoleAuthenticator` per context per
process (``_handlers``), shared by every server socket on it; :func:`release_context` stops it.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import threading
from collections.abc import Iterable, Mapping
from typing import ClassVar, Literal, Self

import msgspec
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from streamrl import wire

log = logging.getLogger(__name__)

Mechanism = Literal["plain", "curve"]

LAUNCHER = "launcher"
DOCK = "dock"
SERVER_ENV = "STREAMRL_SERVER_AUTH"  # a server process's ServerAuth (JSON), from the environment, never argv
CLIENT_ENV = "STREAMRL_CLIENT_AUTH"  # a process's own ClientAuth (JSON), likewise
ZAP_DOMAIN = b"streamrl"


def stage_role(stage: str) -> str:
    """The role every worker of ``stage`` authenticates as."""
    return f"stage:{stage}"


def _digest(password: str) -> str:
    return hashlib.sha256(password.encode()).hexdigest()


class _FromEnv(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Credentials that reach a process in an environment variable (``ENV``, JSON), never argv."""

    ENV: ClassVar[str] = ""

    def to_env(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Self | None:
        """What a launcher put in ``cls.ENV``, or None when it put none."""
        text = (os.environ if environ is None else environ).get(cls.ENV, "")
        return msgspec.json.decode(text, type=cls) if text else None


class ClientAuth(_FromEnv, frozen=True, forbid_unknown_fields=True):
    """One role's credentials, what a client socket of that role presents.

    ``plain``: ``password``. ``curve``: the role's key pair and the run's server public key (z85)."""

    ENV: ClassVar[str] = CLIENT_ENV

    mechanism: Mechanism
    role: str
    password: str = ""
    public: str = ""
    secret: str = ""
    server_public: str = ""

    def __repr__(self) -> str:  # never print a secret into a log
        return f"ClientAuth(mechanism={self.mechanism!r}, role={self.role!r})"

    __str__ = __repr__


class ServerAuth(_FromEnv, frozen=True, forbid_unknown_fields=True):
    """What a server socket needs to verify every role of the run, and no role's secret.

    ``plain``: ``verifiers`` = role -> SHA-256 hex of its password. ``curve``: ``public_roles`` =
    a role's z85 public key -> the role, and the run's server key pair."""

    ENV: ClassVar[str] = SERVER_ENV

    mechanism: Mechanism
    verifiers: dict[str, str] = msgspec.field(default_factory=dict)
    public_roles: dict[str, str] = msgspec.field(default_factory=dict)
    server_public: str = ""
    server_secret: str = ""

    def __repr__(self) -> str:
        roles = sorted(self.verifiers) if self.mechanism == "plain" else sorted(self.public_roles.values())
        return f"ServerAuth(mechanism={self.mechanism!r}, roles={roles!r})"

    __str__ = __repr__

    def role_of(self, mechanism: bytes, credentials: list[bytes]) -> str | None:
        """The role a ZAP request proves, or None (refused). Constant-time comparisons: a
        refusal's timing says nothing about how much of a password was right."""
        if mechanism == b"PLAIN" and self.mechanism == "plain" and len(credentials) == 2:
            role, password = (c.decode("utf-8", "replace") for c in credentials)
            want = self.verifiers.get(role)
            got = _digest(password)
            return role if want is not None and hmac.compare_digest(want, got) else None
        if mechanism == b"CURVE" and self.mechanism == "curve" and len(credentials) == 1:
            return self.public_roles.get(z85.encode(credentials[0]).decode())
        return None


class RunCredentials(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One run's credentials, held by the launcher: every role's, and the servers' verifiers.

    ``plain``: each role's password is HMAC-SHA256(run secret, role). ``curve``: each role has a
    key pair of its own (``keys``: role -> (public, secret)), the servers one more."""

    mechanism: Mechanism
    roles: tuple[str, ...]
    run_secret: str = ""
    keys: dict[str, tuple[str, str]] = msgspec.field(default_factory=dict)
    server_public: str = ""
    server_secret: str = ""

    @classmethod
    def generate(cls, mechanism: Mechanism, roles: Iterable[str]) -> RunCredentials:
        """Fresh credentials for ``roles`` (``launcher`` and ``dock`` are always among them)."""
        if mechanism not in ("plain", "curve"):
            raise ValueError(f"authentication mechanism must be 'plain' or 'curve', got {mechanism!r}")
        every = tuple(dict.fromkeys([LAUNCHER, DOCK, *roles]))
        if mechanism == "plain":
            return cls("plain", every, run_secret=secrets.token_urlsafe(32))
        keys = {}
        for role in every:
            public, secret = zmq.curve_keypair()
            keys[role] = (public.decode(), secret.decode())
        server_public, server_secret = zmq.curve_keypair()
        return cls("curve", every, keys=keys, server_public=server_public.decode(),
                   server_secret=server_secret.decode())

    def __repr__(self) -> str:
        return f"RunCredentials(mechanism={self.mechanism!r}, roles={list(self.roles)!r})"

    __str__ = __repr__

    def _password(self, role: str) -> str:
        return hmac.new(self.run_secret.encode(), role.encode(), hashlib.sha256).hexdigest()

    def client(self, role: str) -> ClientAuth:
        """``role``'s credentials, for the one process (or socket) that acts as it."""
        if role not in self.roles:
            raise KeyError(f"no credentials for role {role!r}; this run's roles: {list(self.roles)}")
        if self.mechanism == "plain":
            return ClientAuth("plain", role, password=self._password(role))
        public, secret = self.keys[role]
        return ClientAuth("curve", role, public=public, secret=secret, server_public=self.server_public)

    def server(self) -> ServerAuth:
        """What every server socket of the run verifies the roles with."""
        if self.mechanism == "plain":
            return ServerAuth("plain", verifiers={r: _digest(self._password(r)) for r in self.roles})
        return ServerAuth("curve", public_roles={pub: role for role, (pub, _) in self.keys.items()},
                          server_public=self.server_public, server_secret=self.server_secret)


class RoleAuthenticator(ThreadAuthenticator):
    """The ZAP handler of one context: admits a connection whose credentials prove a role of the
    run (User-Id = that role), refuses every other (counted in ``refused``)."""

    def __init__(self, context: zmq.Context, auth: ServerAuth) -> None:
        super().__init__(context, log=logging.getLogger(__name__ + ".zap"))
        self.auth = auth
        self._lock = threading.Lock()
        self.accepted = 0
        self.refused = 0
        # a stranger retrying its handshake every 100 ms must not fill the disk: one line a second
        self._warn = wire.SparseLog(log).warning

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        # the whole decision is ours (pyzmq's would set User-Id to the key, not the role)
        if len(msg) < 6:
            if len(msg) >= 2:
                self._send_zap_reply(msg[1], b"400", b"Not enough frames")
            return
        version, request_id, _domain, address, _identity, mechanism = msg[:6]
        role = self.auth.role_of(mechanism, msg[6:]) if version == b"1.0" else None
        with self._lock:
            if role is None:
                self.refused += 1
            else:
                self.accepted += 1
        if role is None:
            self._warn("refused", "refused a %s client from %s: not one of this run's roles (%d refused so far)",
                       mechanism.decode("ascii", "replace"), address.decode("ascii", "replace"), self.refused)
            self._send_zap_reply(request_id, b"400", b"not one of this run's roles")
        else:
            self._send_zap_reply(request_id, b"200", b"OK", role)


class CurveAllowList:
    """A ZAP handler for an external reward server's context (``streamrl reward-server``, its
    key files: :mod:`streamrl.rewards.keys`): CURVE clients whose public key is not allowed are
    refused. ``allowed_keys=None`` accepts any client that completes the CURVE handshake (still
    encrypted, but anyone who knows the server's public key may connect). Start it before binding.
    A run's own sockets use :class:`RoleAuthenticator` instead (roles, not bare keys)."""

    def __init__(self, context: zmq.Context, allowed_keys: Iterable[bytes] | None) -> None:
        self._allowed = None if allowed_keys is None else frozenset(allowed_keys)
        self._authenticator = ThreadAuthenticator(_sync(context), log=logging.getLogger(__name__ + ".zap"))
        self._lock = threading.Lock()
        self.accepted = 0
        self.refused = 0
        self._warn = wire.SparseLog(log).warning  # one line a second, whatever a stranger retries

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
            self._warn("refused", "refused a CURVE client whose public key %s is not on the allow-list "
                       "(%d refused so far)", client_key.decode(), self.refused)
        return allowed

    def stop(self) -> None:
        self._authenticator.stop()


def _sync(context: zmq.Context) -> zmq.Context:
    # ZAP requests travel on inproc:// inside the libzmq context: a sync shadow of an asyncio
    # context reaches the same handler endpoint, and the handler thread needs blocking sockets
    return context if type(context) is zmq.Context else zmq.Context.shadow(context.underlying)


# One ZAP handler per libzmq context (a second bind of its inproc endpoint would fail): every
# server socket of one context in this process shares it. Keyed by the context's address.
_handlers: dict[int, RoleAuthenticator] = {}
_handlers_lock = threading.Lock()


def _handler(context: zmq.Context, auth: ServerAuth) -> RoleAuthenticator:
    with _handlers_lock:
        found = _handlers.get(context.underlying)
        if found is not None:
            if found.auth != auth:
                raise ValueError("one zmq context cannot serve two runs' credentials")
            return found
        handler = RoleAuthenticator(_sync(context), auth)
        handler.start()
        _handlers[context.underlying] = handler
        return handler


def secure_server(sock: zmq.Socket, auth: ServerAuth | None) -> RoleAuthenticator | None:
    """Make ``sock`` admit only the run's roles; call before ``bind``.

    ``auth=None`` leaves the socket open (tests and benchmarks of the bare protocol; a launched
    run always passes its credentials). Returns the context's handler (``refused`` counts the
    strangers turned away)."""
    if auth is None:
        return None
    handler = _handler(sock.context, auth)
    # a handler missing from the context must refuse, not admit everyone (libzmq's default)
    sock.zap_domain = ZAP_DOMAIN
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    if auth.mechanism == "plain":
        sock.plain_server = True
    else:
        sock.curve_secretkey = auth.server_secret.encode()
        sock.curve_publickey = auth.server_public.encode()
        sock.curve_server = True
    return handler


def secure_client(sock: zmq.Socket, auth: ClientAuth | None) -> None:
    """Make ``sock`` present ``auth``'s role to the run's servers; call before ``connect``.
    Per socket: several roles in one process (``inprocess`` runs) each use their own."""
    if auth is None:
        return
    if auth.mechanism == "plain":
        sock.plain_username = auth.role.encode()
        sock.plain_password = auth.password.encode()
    else:
        sock.curve_secretkey = auth.secret.encode()
        sock.curve_publickey = auth.public.encode()
        sock.curve_serverkey = auth.server_public.encode()


def peer_role(frame: zmq.Frame) -> str | None:
    """The role the sender of ``frame`` authenticated as (a frame received with ``copy=False`` on
    a secured server socket), or None on a socket without authentication."""
    try:
        role = frame.get("User-Id")
    except zmq.ZMQError:  # no User-Id: the connection went through no ZAP handler
        return None
    return role or None


def release_context(context: zmq.Context) -> None:
    """Stop the ZAP handler of ``context``, if it has one: call before terminating a context of
    your own (its handler's sockets would keep ``term()`` waiting)."""
    with _handlers_lock:
        found = _handlers.pop(context.underlying, None)
    if found is not None:
        found.stop()


def handler_of(context: zmq.Context) -> RoleAuthenticator | None:
    """The ZAP handler serving ``context`` in this process, if any (its counters, in tests)."""
    with _handlers_lock:
        return _handlers.get(context.underlying)
