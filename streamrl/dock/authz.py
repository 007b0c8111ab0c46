"""Who may do what inside a run: the pipeline's declarations turned into a dock access policy.

Authentication (ZAP, ``streamrl.security``) tells a server *which role* sent a message: the ZAP
User-Id of the connection, ``launcher``, ``dock`` (controller <-> warehouse) or ``stage:<name>``
(every worker of that stage). Authorization, here, decides what that role may do. The policy is
built by the launcher from the pipeline (:meth:`DockPolicy.from_stages`) and handed to the
controller and every warehouse (``--policy`` JSON):

- column names are the pipeline's: a put, ``columns_ready`` or claim naming another is refused
  (``unknown_column``), so no peer can grow the dock's per-sample column bitmask with junk;
- a column is written only by the stage that declares it in ``writes`` (``forbidden`` otherwise):
  no peer can write, say, ``advantage`` before the advantage stage does;
- ``stage:X`` claims, acks and releases only as consumer ``X``; only producing stages (the
  source: no reads, some writes) reserve and close the input; ``launcher`` reads statistics only;
- each role has its own client-id budget (``clients``): one role filling its slots never
  refuses another's clients.

A launched run's policy is ``authenticated``: a message without a role is refused
(``unauthenticated``). A policy with ``authenticated`` false (a dock started without credentials,
for tests and benchmarks of the bare protocol) still enforces the declared column names; the role
rules need a role and so apply only to messages that carry one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import msgspec

from streamrl.dock.state import ProtocolViolation
from streamrl.security import DOCK, LAUNCHER, stage_role

STAGE_PREFIX = "stage:"
# client ids per stage role beyond its worker count: a restarted worker comes back under a new id
# while the dead one's id is kept until its lease TTL (and a worker may open a second client)
CLIENT_MARGIN = 4
LAUNCHER_CLIENTS = 8  # the launcher's statistics and status-page clients (fixed ids, reused)


class AccessDenied(ProtocolViolation):
    """A request the sender's role may not make (answered with an ErrorReply, never fatal)."""


def role_stage(role: str | None) -> str | None:
    """The stage a ``stage:<name>`` role speaks for; None for any other role."""
    if role is not None and role.startswith(STAGE_PREFIX):
        return role[len(STAGE_PREFIX):]
    return None


class StageDecl(Protocol):
    """What the policy needs of a pipeline stage (``streamrl.runtime.pipeline.StageSpec``)."""

    name: str
    reads: list[str]
    writes: list[str]
    workers: int


class DockPolicy(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The pipeline's declarations the dock servers enforce (JSON on their ``--policy`` flag)."""

    columns: dict[str, str]  # column -> the stage that writes it (its only writer)
    stage_reads: dict[str, list[str]]  # stage -> the columns it reads (what it may get)
    producers: list[str]  # stages that reserve samples and close the input
    clients: dict[str, int]  # role -> client ids the controller keeps for it at once
    # refuse every message that carries no ZAP role (set once every socket of the run has ZAP)
    authenticated: bool = False

    @staticmethod
    def from_stages(stages: Iterable[StageDecl], *, authenticated: bool = False) -> DockPolicy:
        stages = list(stages)
        columns = {c: s.name for s in stages for c in s.writes}
        clients = {stage_role(s.name): s.workers + CLIENT_MARGIN for s in stages}
        clients[LAUNCHER] = LAUNCHER_CLIENTS
        return DockPolicy(
            columns=columns,
            stage_reads={s.name: list(s.reads) for s in stages},
            producers=[s.name for s in stages if not s.reads and s.writes],
            clients=clients,
            authenticated=authenticated,
        )

    # ------------------------------------------------------------------ checks
    def require_role(self, role: str | None, what: str) -> None:
        """An authenticated dock answers only messages whose connection has a ZAP role."""
        if role is None and self.authenticated:
            raise AccessDenied("unauthenticated", f"{what} refused: this dock requires an authenticated "
                               "connection (ZAP), and this one carries no role")
        if role is not None and role not in self.clients and role != DOCK:
            raise AccessDenied("forbidden", f"{what} refused: role {role!r} has no rights in this run "
                               f"(roles: {sorted(self.clients)} and {DOCK!r})")

    def check_columns(self, columns: Iterable[str]) -> None:
        unknown = [c for c in columns if c not in self.columns]
        if unknown:
            raise ProtocolViolation("unknown_column", f"column {unknown[0]!r} is not declared by the pipeline "
                                    f"(no stage writes it; declared: {sorted(self.columns)[:32]})")

    def check_write(self, role: str | None, columns: Iterable[str]) -> None:
        """``role`` may mark ``columns`` written: each is declared, and ``role`` is its owner."""
        columns = list(columns)
        self.check_columns(columns)
        if role is None:
            return  # unauthenticated dock: names only (require_role refused None when it must)
        stage = role_stage(role)
        for c in columns:
            if self.columns[c] != stage:
                raise AccessDenied("forbidden", f"role {role!r} may not write column {c!r}: only its owner, "
                                   f"stage {self.columns[c]!r} (pipeline writes), does")

    def check_read(self, role: str | None, columns: Iterable[str]) -> None:
        """``role`` may get ``columns``: declared, and among its stage's reads or writes."""
        columns = list(columns)
        self.check_columns(columns)
        if role is None:
            return
        stage = role_stage(role)
        allowed = set(self.stage_reads.get(stage, ())) | {c for c, w in self.columns.items() if w == stage}
        denied = [c for c in columns if c not in allowed]
        if stage is None or denied:
            raise AccessDenied("forbidden", f"role {role!r} may not read column {(denied or columns)[0]!r}: a "
                               "stage reads only the columns it declares in reads or writes")

    def check_consumer(self, role: str | None, consumer: str, what: str) -> None:
        """``role`` may claim/ack/release as ``consumer``: only that consumer's own stage."""
        if role is not None and role_stage(role) != consumer:
            raise AccessDenied("forbidden", f"{what} as consumer {consumer!r} refused for role {role!r}: only "
                               f"{stage_role(consumer)!r} claims, acks and releases that consumer's samples")

    def check_producer(self, role: str | None, what: str) -> None:
        """``role`` may reserve samples / close the input: only a producing (source) stage."""
        if role is not None and role_stage(role) not in self.producers:
            raise AccessDenied("forbidden", f"{what} refused for role {role!r}: only producing stages "
                               f"{[stage_role(s) for s in self.producers]} create samples")

    def check_not_dock(self, role: str | None, what: str) -> None:
        if role == DOCK:
            raise AccessDenied("forbidden", f"{what} refused for role {DOCK!r}: warehouses only register "
                               "and announce columns")

    def check_dock(self, role: str | None, what: str) -> None:
        if role is not None and role != DOCK:
            raise AccessDenied("forbidden", f"{what} refused for role {role!r}: only the dock's own servers "
                               f"(role {DOCK!r}) send it")


def parse_policy(text: str) -> DockPolicy:
    """``--policy`` JSON of the dock servers, as :class:`DockPolicy` encodes it."""
    try:
        return msgspec.json.decode(text, type=DockPolicy)
    except msgspec.DecodeError as exc:
        raise ValueError(f"--policy must be a DockPolicy as JSON: {exc}") from None
