"""Resource limits of the dock servers, and the per-run secret that authenticates warehouses.

The *wire* bounds (list lengths, name lengths, number ranges) are protocol constants in
:mod:`streamrl.dock.protocol`: every implementation must agree on them. The limits here are the
servers' own resources, set per run (``resources.dock.*`` in a run config, ``--max-...`` flags
on the server command lines); docs/dock-protocol.md §6.1 lists both.
"""

from __future__ import annotations

import argparse
import os
import secrets
from dataclasses import dataclass

SECRET_ENV = "STREAMRL_DOCK_SECRET"  # env, not argv: argv is world-readable in ps / /proc/*/cmdline
MIB = 1 << 20


# Allowed range of each limit: checked here and declared on resources.dock.* in the run config.
LIMIT_BOUNDS: dict[str, tuple[int, int]] = {
    "max_message_mib": (1, 1 << 16), "max_header_mib": (1, 1 << 12), "max_clients": (1, 1 << 24),
    "max_parked": (1, 1 << 24), "reserve_ttl_s": (1, 86_400),
}


@dataclass(frozen=True)
class DockLimits:
    # ZMQ_MAXMSGSIZE of every warehouse and client socket, per frame: a peer declaring a longer
    # frame is disconnected by libzmq before the memory is allocated. 1 GiB holds any single
    # tensor a dock carries in practice (a 64 x 32k-token micro-batch of fp32 logprobs is 8 MiB)
    max_message_mib: int = 1024
    # MAXMSGSIZE of the controller (which only ever receives headers) and the largest header a
    # warehouse decodes: a header of 2^20 indices with versions and lengths is ~30 MiB
    max_header_mib: int = 64
    # client ids the controller keeps state for at once; idle ones are forgotten after their TTL
    max_clients: int = 4096
    # claims and reserves the controller holds open (long-poll) at once, over all clients
    max_parked: int = 65_536
    # a reserved sample not written by its creator within this many seconds expires and its
    # capacity returns (reserved samples have no lease: a producer that dies between reserve
    # and put, or never writes, would hold capacity for ever). Far above a put's duration
    reserve_ttl_s: int = 60

    def __post_init__(self) -> None:
        for name, (lo, hi) in LIMIT_BOUNDS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise ValueError(f"dock limit {name} must be an integer in [{lo}, {hi}], got {value!r} "
                                 f"(resources.dock.{name} in the run config)")

    @property
    def max_message_bytes(self) -> int:
        return self.max_message_mib * MIB

    @property
    def max_header_bytes(self) -> int:
        return self.max_header_mib * MIB

    def argv(self) -> list[str]:
        """Command-line flags that give a server process these limits (see add_arguments)."""
        return ["--max-message-mib", str(self.max_message_mib), "--max-header-mib", str(self.max_header_mib),
                "--max-clients", str(self.max_clients), "--max-parked", str(self.max_parked),
                "--reserve-ttl-s", str(self.reserve_ttl_s)]

    @staticmethod
    def add_arguments(ap: argparse.ArgumentParser) -> None:
        d = DockLimits()
        ap.add_argument("--max-message-mib", type=int, default=d.max_message_mib,
                        help="largest frame a warehouse or client accepts (ZMQ_MAXMSGSIZE), MiB")
        ap.add_argument("--max-header-mib", type=int, default=d.max_header_mib,
                        help="largest header (and controller message), MiB")
        ap.add_argument("--max-clients", type=int, default=d.max_clients, help="live client ids at once")
        ap.add_argument("--max-parked", type=int, default=d.max_parked, help="claims/reserves/stats held open at once")
        ap.add_argument("--reserve-ttl-s", type=int, default=d.reserve_ttl_s,
                        help="seconds after which reserved samples never written expire")

    @staticmethod
    def from_args(args: argparse.Namespace) -> DockLimits:
        return DockLimits(args.max_message_mib, args.max_header_mib, args.max_clients, args.max_parked,
                          args.reserve_ttl_s)


def new_secret() -> str:
    """A fresh per-run warehouse secret (128 bits, hex)."""
    return secrets.token_hex(16)


def secret_from_env() -> str:
    """The secret a server process was started with; a clear error if the starter forgot it."""
    value = os.environ.get(SECRET_ENV, "")
    if not value:
        raise ValueError(f"{SECRET_ENV} is not set: give the controller and every warehouse the same secret in "
                         f"this environment variable (LocalDock does it for you), e.g. {SECRET_ENV}=$(openssl "
                         "rand -hex 16)")
    return value
