"""This machine's addresses as other hosts see them, and stores that listen on one of them.

Not `gethostbyname(getfqdn())`: on stock Debian/Ubuntu hosts /etc/hosts maps the host's own name
to 127.0.1.1, which no other machine can reach and which names no interface."""

from __future__ import annotations

import socket
from datetime import timedelta

import psutil
import torch.distributed as dist


def address_towards(host: str) -> str:
    """The local address this machine sends from when it talks to `host` (the kernel's route;
    a UDP connect sends no packet)."""
    peer = socket.gethostbyname(host)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((peer, 9))
        return probe.getsockname()[0]


def local_addresses() -> set[str]:
    """Every IPv4 address of this machine's interfaces, with its names."""
    found = {socket.gethostname(), socket.getfqdn()}
    for addresses in psutil.net_if_addrs().values():
        found |= {a.address for a in addresses if a.family == socket.AF_INET}
    return found


def free_port() -> int:
    """A TCP port free right now on this host (for rendezvous and local servers)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def listening_socket(address: str, port: int = 0) -> tuple[int, int]:
    """(port, descriptor) of a socket listening on `address` only, for a TCPStore server's
    `master_listen_fd` (TCPStore itself binds every interface); the store owns it after."""
    sock = socket.create_server((address, port), backlog=1024)
    return sock.getsockname()[1], sock.detach()


def listening_store(address: str, world_size: int, timeout: timedelta):
    """A torch TCPStore server that listens on `address` only, on a free port."""
    port, fd = listening_socket(address)
    return dist.TCPStore(address, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=fd)
