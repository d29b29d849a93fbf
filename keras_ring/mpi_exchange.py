"""The exchange under an MPI launcher: host identities, addresses and a job token over
MPI_COMM_WORLD, through mpi4py (only for this exchange: MPI is not the data plane).

mpi4py is imported when the exchange runs, never at import: MPI is optional (``pip install
keras-ring[mpi]``), and a program launched otherwise must not load it.
"""

from __future__ import annotations

import secrets
import socket
import sys

from keras_ring import interfaces
from keras_ring._errors_base import InitError
from keras_ring.config import Config
from keras_ring.peer_table import (PeerTable, Topology, check_hosts, listen, offered_addresses,
                                   reachable_addresses)


def mpi_bootstrap(config: Config) -> PeerTable:
    """Exchanges host identities, addresses and a job token over MPI_COMM_WORLD.

    When keras_ring is the one that brings MPI up, it also takes it down right after the
    exchange: an MPI still initialised at exit makes survivors of a dead rank hang in
    MPI_Finalize, and MPI's own shared-memory segments would outlive a killed job. A program
    that imported mpi4py itself keeps its MPI.
    """
    user_owns_mpi = "mpi4py.MPI" in sys.modules
    try:
        from mpi4py import MPI
    except ModuleNotFoundError as e:
        if e.name != "mpi4py":
            raise
        raise InitError("an MPI launcher started this process, but mpi4py is not installed: "
                        "pip install keras-ring[mpi] (or launch without MPI through the "
                        "KERAS_RING_RENDEZVOUS variables)") from None

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
        raise InitError(problem)
    topology = Topology.from_host_ids(rank, host_ids)
    if size == 1:
        return PeerTable(topology, via_mpi=True)
    multi_host = len(set(host_ids)) > 1
    listener = listen(multi_host, size)
    try:
        offered, why = offered_addresses(config) if multi_host else ("127.0.0.1", None)
        entries = comm.allgather((offered, why, listener.getsockname()[1]))
        for r, (_, error, _) in enumerate(entries):
            if error:
                raise InitError(f"rank {r} (host '{host_ids[r]}'): {error}")
        addresses = reachable_addresses(rank, host_ids, [s for _, s in claims],
                                        [a for a, _, _ in entries], [p for _, _, p in entries])
        token = comm.bcast(secrets.randbits(63) if rank == 0 else None, root=0)
    except BaseException:
        listener.close()
        raise
    return PeerTable(topology, addresses, token, listener, via_mpi=True)
