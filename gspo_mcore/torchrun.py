"""`python -m gspo_mcore.torchrun ...`: torchrun whose own stores listen on one address.

torchrun's rendezvous store (and the agent store its workers share) is a TCPStore, which binds
every interface; torch 2.13 has no bind address for it. Here the store's socket is bound
first, to the address its host name resolves to, and handed over (`master_listen_fd`), so a
single-node run (`--standalone`: localhost) listens on loopback only and a multi-node run on
the rendezvous address only. When the name resolves to a loopback address that is not what
it says (a node's own name on stock Debian/Ubuntu maps to 127.0.1.1, which other nodes cannot
reach), it keeps torch's bind-all rather than break the job. Arguments are torchrun's."""

from __future__ import annotations

import ipaddress
import socket

import torch.distributed as dist

from gspo_mcore.netaddr import listening_socket

_TCPStore = dist.TCPStore
_LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}


def bind_address(host: str) -> str | None:
    """The address to listen on for a store named `host`, or None (every interface)."""
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return None
    if ipaddress.ip_address(address).is_loopback and host not in _LOOPBACK_NAMES:
        return None
    return address


class BoundTCPStore(_TCPStore):
    """A TCPStore whose server, when this process hosts it, listens on `bind_address(host)`."""

    def __init__(self, host_name, port, *args, **kwargs):
        names = ("world_size", "is_master", "timeout", "wait_for_workers", "multi_tenant", "master_listen_fd")
        given = dict(zip(names, args), **kwargs)
        address = bind_address(host_name) if given.get("is_master") and given.get("master_listen_fd") is None else None
        if address is not None:
            port, given["master_listen_fd"] = listening_socket(address, port)
        super().__init__(host_name, port, **given)


def main() -> None:
    dist.TCPStore = BoundTCPStore  # before torchrun's modules bind the name
    from torch.distributed.run import main as torchrun

    torchrun()


if __name__ == "__main__":
    main()
