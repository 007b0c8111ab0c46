"""The torch.distributed rendezvous of a run that spans hosts: a store served by the launcher.

On one host the workers of a world meet through a ``FileStore`` in the run directory. Across
hosts that would need a shared filesystem. So ``resources.launch: ray`` has the launcher serve
torch's own ``TCPStore``: :class:`RendezvousServer` binds it to the driver node's address (one
interface, not all of them as ``TCPStore`` does by itself: it is handed a socket this module
bound, ``master_listen_fd``) at a port from the OS, and every worker's spec carries
``HOST:PORT``. :func:`connect_store` is a worker's end, one key prefix per world.

Why not a store over the run's CURVE channel: torch clones a group's store in C++
(``Store::clone``), which a Python ``torch.distributed.Store`` subclass cannot provide, so
``new_group`` fails on one (seen with torch 2.13). The store, like gloo's and nccl's own
connections, is therefore torch's, unauthenticated: run the cluster on a trusted network
(docs/ray.md says so). What streamrl serves itself — dock, control and policy channels — uses
CURVE.
"""

from __future__ import annotations

import datetime
import socket

import torch.distributed as dist


class RendezvousServer:
    """A ``TCPStore`` served from this process on ``host`` only, until :meth:`close`."""

    def __init__(self, host: str, *, timeout_s: float = 300.0) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.bind((host, 0))
        self._listener.listen(1024)
        self.port = int(self._listener.getsockname()[1])
        self.endpoint = f"{host}:{self.port}"
        self.store = dist.TCPStore(host, self.port, None, True, timeout=datetime.timedelta(seconds=timeout_s),
                                   wait_for_workers=False, master_listen_fd=self._listener.fileno())
        self._listener.detach()  # the store's server owns the socket now and closes it with itself

    def close(self) -> None:
        del self.store


def connect_store(endpoint: str, prefix: str, *, timeout_s: float) -> dist.Store:
    """A worker's end of the launcher's store: keys of world ``prefix`` (e.g. the train stage's
    name) apart from every other world's."""
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"rendezvous endpoint must be HOST:PORT, got {endpoint!r}")
    store = dist.TCPStore(host.strip("[]"), int(port), None, False, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    return dist.PrefixStore(prefix.rstrip("/") + "/", store)
