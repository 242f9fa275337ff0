"""`python -m gspo_mcore.run.torchrun ...`: torchrun whose own stores listen on one address, and
whose workers get a gloo interface and OpenMP threads chosen for the node. Arguments are torchrun's.

- Stores: torchrun's rendezvous store (and the agent store its workers share) is a TCPStore,
  which binds every interface; torch 2.13 has no bind address for it. Here the store's socket
  is bound first, to the address its host name resolves to, and handed over
  (`master_listen_fd`), so a single-node run (`--standalone`: localhost) listens on loopback
  only and a multi-node run on the rendezvous address only. When the name resolves to a
  loopback address that is not what it says (a node's own name on stock Debian/Ubuntu maps to
  127.0.1.1, which other nodes cannot reach), it keeps torch's bind-all rather than break the job.
- GLOO_SOCKET_IFNAME, unless set: the interface whose address routes to the rendezvous host.
  Megatron's gloo groups otherwise bind the address the host name resolves to, which on
  clusters can be another network than the one the nodes reach each other on. Left unset for
  a loopback rendezvous (one node: the default works, and a loopback interface would cut
  gloo groups to servers on other hosts).
- OMP_NUM_THREADS, unless set: the cores this process may run on over the node's ranks
  (torchrun's default is 1, which leaves a CPU-offloaded Adam step on one core per rank).
- Signals, unless given: SIGUSR1 (Slurm's time-limit warning) is passed to the workers like
  SIGTERM and SIGINT (torchrun's agent hands the signal it got to every worker:
  LocalElasticAgent._shutdown), and the agent waits GSPO_SAVE_TIMEOUT_S (default 540 s, inside
  the sbatch templates' 600 s warning) before SIGKILL: the trainer saves its last completed step
  on these signals (gspo_mcore.run.preemption), where torchrun's own 30 s would cut a 30B save short.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys

import torch.distributed as dist

from gspo_mcore.common.netaddr import address_towards, listening_socket
import psutil

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


def interface_towards(host: str) -> str | None:
    """The name of the local interface holding the address this machine sends from to `host`."""
    address = address_towards(host)
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addresses):
            return name
    return None


def gloo_interface(host: str | None) -> str | None:
    """GLOO_SOCKET_IFNAME for a rendezvous at `host`; None for none, a loopback route or an
    unresolvable name (gloo's own default then)."""
    if not host:
        return None
    try:
        if ipaddress.ip_address(address_towards(host)).is_loopback:
            return None
        return interface_towards(host)
    except OSError:
        return None


def rendezvous_host(args) -> str | None:
    """The rendezvous host torchrun's parsed `args` name; None for --standalone (localhost)."""
    # torch.distributed.run / elastic: imported after main's TCPStore patch (they bind the name at import).
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    if args.standalone:
        return None
    endpoint = args.rdzv_endpoint or (args.master_addr if args.rdzv_backend == "static" else "")
    return parse_rendezvous_endpoint(endpoint, default_port=29400)[0] if endpoint else None


def omp_threads(ranks_per_node: int) -> int:
    """OpenMP threads per rank: the cores this process may run on (Slurm's and cgroups' cpuset
    included) over the node's ranks."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, ranks_per_node))


def worker_environment(args, environ) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME and OMP_NUM_THREADS for the workers, those `environ` lacks."""
    from torch.distributed.run import determine_local_world_size

    chosen = {}
    if "GLOO_SOCKET_IFNAME" not in environ:
        interface = gloo_interface(rendezvous_host(args))
        if interface:
            chosen["GLOO_SOCKET_IFNAME"] = interface
    if "OMP_NUM_THREADS" not in environ:
        try:
            chosen["OMP_NUM_THREADS"] = str(omp_threads(determine_local_world_size(args.nproc_per_node)))
        except ValueError:  # e.g. --nproc-per-node gpu without a GPU: torchrun reports it
            pass
    return chosen


SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def with_signal_defaults(argv: list[str], environ) -> list[str]:
    """torchrun's arguments with the signals and the shutdown timeout above, unless given."""
    options = {a.split("=")[0].replace("_", "-") for a in argv}
    extra = []
    if "--signals-to-handle" not in options and "PET_SIGNALS_TO_HANDLE" not in environ:
        extra += ["--signals-to-handle", SIGNALS_TO_HANDLE]
    if "--shutdown-timeout" not in options and "PET_SHUTDOWN_TIMEOUT" not in environ:
        extra += ["--shutdown-timeout", environ.get("GSPO_SAVE_TIMEOUT_S", "540")]
    return [*extra, *argv]


def main() -> None:
    dist.TCPStore = BoundTCPStore  # before torchrun's modules bind the name
    from torch.distributed.run import main as torchrun, parse_args  # after the patch above

    argv = with_signal_defaults(sys.argv[1:], os.environ)
    chosen = worker_environment(parse_args(argv), os.environ)
    if chosen:  # the workers inherit this process's environment
        os.environ.update(chosen)
        print("gspo_mcore.run.torchrun: " + " ".join(f"{k}={v}" for k, v in chosen.items()), file=sys.stderr, flush=True)
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        torchrun(argv)
    except SignalException as stop:  # the workers got it too and said what they did: no traceback here
        sys.exit(128 + int(stop.sigval))


if __name__ == "__main__":
    main()
