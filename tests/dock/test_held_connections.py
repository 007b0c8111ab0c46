"""Held connections do not lock new clients out of the dock controller (issue 25).

At the common soft fd limit of 1024, 1100 idle TCP connections left libzmq's listener unable to
accept (EMFILE) and new clients waited until they were closed. The controller now raises its soft
limit to the hard one at start. Loopback only; the connections are closed at the end.
"""

from __future__ import annotations

import resource
from collections.abc import Iterator
from contextlib import contextmanager

import msgpack
import pytest
import zmq

from ops.fuzz.zmtp import hold_connections
from streamrl import wire
from streamrl.dock.launch import LocalDock

pytestmark = pytest.mark.timeout(120)

HELD = 1100  # the tester's count: past the common soft limit of 1024


@contextmanager
def soft_fd_limit(limit: int) -> Iterator[None]:
    """Children started inside inherit a soft RLIMIT_NOFILE of ``limit``, as on a default system."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(limit, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_held_connections_do_not_lock_new_clients_out_of_the_controller() -> None:
    if wire.raise_fd_limit() < HELD + 200 or resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 2 * HELD:
        pytest.skip("the hard fd limit here is too low to hold the connections")
    with soft_fd_limit(1024):
        dock = LocalDock(["gen"], capacity=8, n_warehouses=1).start()
    try:
        port = int(dock.controller_endpoint.rsplit(":", 1)[1])
        held = hold_connections("127.0.0.1", port, HELD)
        try:
            context = zmq.Context()
            try:
                sock = context.socket(zmq.DEALER)
                sock.linger = 0
                sock.connect(dock.controller_endpoint)
                sock.send(msgpack.packb({"type": "stats", "req_id": 1}))
                assert sock.poll(10_000), f"a new client got no reply while {HELD} connections were held"
                assert msgpack.unpackb(sock.recv())["type"] == "stats_reply"
            finally:
                context.destroy(linger=0)
        finally:
            for s in held:
                s.close()
        assert dock.alive()
    finally:
        dock.stop()
