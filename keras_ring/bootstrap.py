"""How ranks find each other: rank, size, host map and the addresses the transports need.

The bootstrap runs once in ``init()`` and hands the C++ runtime a complete peer table. Under
an MPI launcher it uses mpi4py (only for this exchange: MPI is not the data plane); a plain
``python train.py`` is a world of one and imports no MPI at all.
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
from dataclasses import dataclass, field

from keras_ring import interfaces
from keras_ring.config import Config

# Variables that MPI launchers (MPICH/Hydra, Open MPI, Intel MPI, Slurm's PMI) set in ranks.
_LAUNCHER_VARIABLES = (
    "PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS",
    "HYDRA_CONTROL_FD", "PMI_FD",
)


@dataclass(frozen=True)
class Topology:
    """Where this process sits in the job."""

    rank: int
    size: int
    local_rank: int  # index among the ranks on this host
    local_size: int
    cross_rank: int  # index among the ranks with this local_rank (i.e. the host's index)
    cross_size: int
    host_ids: tuple[str, ...]  # per rank, what identifies its host

    @classmethod
    def from_host_ids(cls, rank: int, host_ids: list[str]) -> "Topology":
        size = len(host_ids)
        local = [r for r in range(size) if host_ids[r] == host_ids[rank]]
        local_rank_of = [
            sum(1 for q in range(r) if host_ids[q] == host_ids[r]) for r in range(size)
        ]
        cross = [r for r in range(size) if local_rank_of[r] == local_rank_of[rank]]
        return cls(
            rank=rank, size=size, local_rank=local.index(rank), local_size=len(local),
            cross_rank=cross.index(rank), cross_size=len(cross), host_ids=tuple(host_ids),
        )


@dataclass
class PeerTable:
    """Everything the runtime needs to connect: topology, addresses, job token, listener."""

    topology: Topology
    addresses: list[tuple[str, int]] = field(default_factory=list)
    job_token: int = 0
    listener: socket.socket | None = None

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None


def launched_by_mpi() -> bool:
    """True when an MPI launcher started this process."""
    return any(v in os.environ for v in _LAUNCHER_VARIABLES)


def _listen(multi_host: bool, backlog: int) -> socket.socket:
    # One host: loopback only, nothing is exposed. Several: every interface, IPv6 as well as
    # IPv4 where the system allows both (peers may advertise either).
    backlog = max(backlog, 8)
    if not multi_host:
        return socket.create_server(("127.0.0.1", 0), backlog=backlog)
    if socket.has_dualstack_ipv6():
        return socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True,
                                    backlog=backlog)
    return socket.create_server(("0.0.0.0", 0), backlog=backlog)


def check_hosts(host_ids: list[str], stack_ids: list[str]) -> str | None:
    """What is wrong with the ranks' host claims, or None.

    Ranks with one host identity talk over loopback and shared memory, so they must share a
    network stack (one machine, one network namespace): two machines with the same host name
    would otherwise fail only at the timeout, with "connection refused".
    """
    first: dict[str, int] = {}
    for rank, (host, stack) in enumerate(zip(host_ids, stack_ids)):
        other = first.setdefault(host, rank)
        if stack_ids[other] != stack:
            return (f"ranks {other} and {rank} both claim host '{host}' but run on different "
                    "machines or network namespaces (they cannot reach each other over "
                    "loopback): give each host its own KERAS_RING_HOST_ID (the default, the "
                    "host name, is the same on these hosts)")
    return None


def reachable_addresses(rank: int, host_ids: list[str], stacks: list[str],
                        offered: list[str], ports: list[int]) -> list[tuple[str, int]]:
    """How this rank reaches every rank: (comma-separated candidates, port) per rank.

    Ranks on this host, or in this network stack (a host map faked on one machine), are
    reached over loopback whatever they offer. A loopback candidate of a rank in another
    known stack is dropped: there it would reach some other process on this machine.
    """
    out = []
    for r, (host, stack, addresses, port) in enumerate(zip(host_ids, stacks, offered, ports)):
        if host == host_ids[rank] or (stack and stack == stacks[rank]):
            out.append(("127.0.0.1", port))
            continue
        candidates = [interfaces.routable(a.strip()) for a in addresses.split(",") if a.strip()]
        if stack and stacks[rank]:
            candidates = [a for a in candidates if not interfaces.is_loopback(a)]
        if not candidates:
            raise _init_error(f"rank {r} (host '{host}') offered no address that rank {rank} "
                              f"can reach (it offered {addresses!r})")
        out.append((",".join(dict.fromkeys(candidates)), port))
    return out


def offered_addresses(config: Config) -> tuple[str, str | None]:
    """This rank's candidate addresses, comma-separated, or ("", why there are none)."""
    try:
        return ",".join(interfaces.candidate_addresses(config.advertise_address,
                                                      config.socket_ifname)), None
    except interfaces.AddressError as e:
        return "", str(e)


def _init_error(message: str) -> Exception:
    from keras_ring.errors import InitError  # here: errors imports TensorFlow

    return InitError(message)


def single_process() -> PeerTable:
    return PeerTable(Topology.from_host_ids(0, [socket.gethostname()]))


def mpi_bootstrap(config: Config) -> PeerTable:
    """Exchanges host identities, addresses and a job token over MPI_COMM_WORLD.

    When keras_ring is the one that brings MPI up, it also takes it down right after the
    exchange: an MPI still initialised at exit makes survivors of a dead rank hang in
    MPI_Finalize, and MPI's own shared-memory segments would outlive a killed job. A program
    that imported mpi4py itself keeps its MPI.
    """
    user_owns_mpi = "mpi4py.MPI" in sys.modules
    from mpi4py import MPI

    try:
        return _exchange(MPI.COMM_WORLD, config)
    finally:
        if not user_owns_mpi and MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.Finalize()


def _exchange(comm, config: Config) -> PeerTable:
    rank, size = comm.Get_rank(), comm.Get_size()
    host_id = config.host_id or socket.gethostname()
    claims = comm.allgather((host_id, interfaces.network_stack_id()))
    host_ids = [h for h, _ in claims]
    problem = check_hosts(host_ids, [s for _, s in claims])
    if problem:  # every rank sees the same claims, so every rank raises this
        raise _init_error(problem)
    topology = Topology.from_host_ids(rank, host_ids)
    if size == 1:
        return PeerTable(topology)
    multi_host = len(set(host_ids)) > 1
    listener = _listen(multi_host, size)
    try:
        offered, why = offered_addresses(config) if multi_host else ("127.0.0.1", None)
        entries = comm.allgather((offered, why, listener.getsockname()[1]))
        for r, (_, error, _) in enumerate(entries):
            if error:
                raise _init_error(f"rank {r} (host '{host_ids[r]}'): {error}")
        addresses = reachable_addresses(rank, host_ids, [s for _, s in claims],
                                        [a for a, _, _ in entries], [p for _, _, p in entries])
        token = comm.bcast(secrets.randbits(63) if rank == 0 else None, root=0)
    except BaseException:
        listener.close()
        raise
    return PeerTable(topology, addresses, token, listener)


def bootstrap(config: Config) -> PeerTable:
    """The peer table for this process, from whichever launcher started it."""
    from keras_ring import rendezvous  # here: it builds on this module

    table = rendezvous.from_env(config)  # KERAS_RING_RENDEZVOUS & co. win over MPI
    if table is not None:
        return table
    if launched_by_mpi():
        return mpi_bootstrap(config)
    return single_process()
