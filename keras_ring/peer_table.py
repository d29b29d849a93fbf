"""The peer table every exchange produces: topology, addresses, job token and listener.

The exchanges (``keras_ring.mpi_exchange``, ``keras_ring.rendezvous``, ``keras_ring.spark``)
swap what each rank knows and build this table from the result with the helpers here; the
runtime connects the ranks from it. Nothing here imports TensorFlow or MPI.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from keras_ring import interfaces
from keras_ring._errors_base import InitError
from keras_ring.config import Config


class RendezvousGuard(Protocol):
    """What the peer table holds of a rendezvous kept open (rendezvous.LateClaims)."""

    claimed: str | None  # why the job must fail, once a rank was claimed again
    on_claim: Callable[[str], None] | None

    def close(self) -> None: ...


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
    via_mpi: bool = False  # found through MPI_COMM_WORLD (mpirun), for mpi_enabled()
    # Each rank's MPI_COMM_WORLD rank where the job is a communicator's processes
    # (init(comm=...)); None where the ranks are MPI_COMM_WORLD's or there is no MPI.
    world_ranks: list[int] | None = None
    # Rank 0's rendezvous port, held while the process lives (rendezvous.LateClaims), or None.
    late_claims: RendezvousGuard | None = None

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        if self.late_claims is not None:
            self.late_claims.close()
            self.late_claims = None


def single_process() -> PeerTable:
    """The table of a world of one: no peers, no listener."""
    return PeerTable(Topology.from_host_ids(0, [socket.gethostname()]))


def listen(multi_host: bool, backlog: int) -> socket.socket:
    """The runtime's listening socket, on an ephemeral port.

    Args:
        multi_host: whether ranks on other hosts connect to it. One host: loopback only,
            nothing is exposed. Several: every interface, IPv6 as well as IPv4 where the
            system allows both (peers may advertise either).
        backlog: how many connections may wait (at least 8).
    """
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

    Raises:
        InitError: a rank in another stack offered no address this rank can reach.
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
            raise InitError(f"rank {r} (host '{host}') offered no address that rank {rank} "
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
