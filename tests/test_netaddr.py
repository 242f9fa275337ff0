import socket
from datetime import timedelta

import psutil
import pytest

from gspo_mcore.common.netaddr import address_towards, listening_store, local_addresses
from gspo_mcore.weight_sync.tensor import colocated_readers


def _interface_address() -> str:
    addresses = [a for a in local_addresses() if a[0].isdigit() and not a.startswith("127.")]
    if not addresses:
        pytest.skip("this machine has no non-loopback IPv4 interface")
    return sorted(addresses)[0]


def test_addresses_come_from_interfaces_not_the_hostname_lookup(monkeypatch):
    """On stock Debian/Ubuntu the host's own name resolves to 127.0.1.1: neither the address a
    server should call back nor one that matches a server URL naming this host by its IP."""
    ip = _interface_address()
    real = socket.gethostbyname
    monkeypatch.setattr(socket, "gethostbyname",
                        lambda host: "127.0.1.1" if host in (socket.gethostname(), socket.getfqdn()) else real(host))
    assert address_towards(ip) == ip and address_towards("127.0.0.1") == "127.0.0.1"
    assert ip in local_addresses() and "127.0.1.1" not in local_addresses()
    # tensor sync: the server named by this host's IP is matched to the trainer rank on this host
    assert colocated_readers([f"http://{ip}:30000"], [1], [(local_addresses(), 0)]) == [[0]]


def test_the_store_listens_on_the_given_address_only():
    store = listening_store("127.0.0.1", 1, timedelta(seconds=10))
    store.set("k", "v")
    listening = {c.laddr for c in psutil.Process().net_connections("inet") if c.status == psutil.CONN_LISTEN}
    assert ("127.0.0.1", store.port) in {(a.ip, a.port) for a in listening}
    assert not any(a.port == store.port and a.ip in ("0.0.0.0", "::") for a in listening)
    import torch.distributed as dist

    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))
    assert client.get("k") == b"v"


def test_torchrun_store_binds_the_rendezvous_address(monkeypatch):
    from gspo_mcore.run.torchrun import bind_address

    assert bind_address("localhost") == "127.0.0.1" and bind_address("127.0.0.1") == "127.0.0.1"
    ip = _interface_address()
    assert bind_address(ip) == ip
    # A node's own name that resolves to 127.0.1.1 (stock Debian/Ubuntu): binding it would cut
    # the other nodes off, so every interface, as torch does.
    monkeypatch.setattr(socket, "gethostbyname", lambda host: "127.0.1.1")
    assert bind_address("gpu-node-0") is None


PROBE = """
import json, os, psutil
agent = psutil.Process(os.getppid())
print(json.dumps(sorted({c.laddr.ip for c in agent.net_connections("inet") if c.status == psutil.CONN_LISTEN})))
"""


@pytest.mark.slow  # torchrun in a subprocess
def test_a_single_node_run_listens_on_loopback_only(tmp_path):
    """torchrun --standalone's rendezvous store listened on every interface ('::')."""
    import json
    import subprocess
    import sys

    from helpers import environment

    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    env = environment()
    proc = subprocess.run([sys.executable, "-m", "gspo_mcore.run.torchrun", "--standalone", "--nproc_per_node", "1",
                           str(probe)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == ["127.0.0.1"]
