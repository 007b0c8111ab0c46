"""Exceptions raised by the transfer dock. Each names what went wrong and what to do."""

from __future__ import annotations


class DockError(Exception):
    """Base class of every error the dock raises."""


class DockTimeout(DockError, TimeoutError):
    """A dock request got no answer within its timeout (server down, overloaded, or wrong endpoint)."""


class DockFull(DockError):
    """The dock is at capacity (samples in flight); `reserve_nowait` raises it instead of waiting."""


class NothingToClaim(DockError):
    """`claim_nowait` found no ready sample for this consumer."""


class EndOfStream(DockError):
    """The producer closed the input and this consumer has had every sample: nothing will come."""


class RemoteError(DockError):
    """A dock server refused a request; the message says which field or input was bad."""

    def __init__(self, server: str, code: str, message: str) -> None:
        super().__init__(f"{server} refused the request ({code}): {message}")
        self.server = server
        self.code = code
        self.message = message


class WireFormatError(DockError):
    """Frames on a dock socket do not follow docs/dock-protocol.md."""
