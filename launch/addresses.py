"""`python launch/addresses.py NODE...`: for each node of a job, the address its engine servers
listen on and the trainer reaches them at (one per line, in order). Used by launch/node.sh so a
server listens on one address, never on every interface (0.0.0.0).

A node's address is what the job's name service gives for its name, the same on every node. A
node whose own name resolves to loopback on itself (Debian's /etc/hosts: 127.0.1.1) would listen
where no other node reaches it: it takes the address it sends from towards the other nodes
(gspo_mcore.common.netaddr.address_towards). A job of one node stays on loopback."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gspo_mcore.common.netaddr import address_towards  # noqa: E402


def resolve(name: str) -> str:
    try:
        return socket.gethostbyname(name)
    except OSError as err:
        raise SystemExit(f"error: launch/addresses.py: node {name!r} does not resolve ({err})") from None


def node_addresses(nodes: list[str]) -> list[str]:
    resolved = [resolve(name) for name in nodes]
    distinct = set(resolved)
    out = []
    for name, address in zip(nodes, resolved):
        peers = [a for a in distinct if a != address and not a.startswith("127.")]
        if address.startswith("127.") and peers:
            address = address_towards(peers[0])
        out.append(address)
    return out


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: python launch/addresses.py NODE...")
    print("\n".join(node_addresses(sys.argv[1:])))
