"""How ranks find each other: which exchange builds this process's peer table.

The bootstrap runs once in ``init()`` and hands the C++ runtime a complete peer table
(``keras_ring.peer_table``): through the environment rendezvous when its variables are set
(``keras_ring.rendezvous``), else over MPI when an MPI launcher started the process
(``keras_ring.mpi_exchange``), else as a world of one, which imports no MPI at all.

The peer-table names are importable from here too, where they were defined before.
"""

from __future__ import annotations

import os

from keras_ring import rendezvous
from keras_ring.config import MPI_LAUNCHER_VARIABLES, Config
from keras_ring.mpi_exchange import mpi_bootstrap
from keras_ring.peer_table import (PeerTable, Topology, check_hosts, offered_addresses,
                                   reachable_addresses, single_process)

__all__ = [
    "bootstrap", "launched_by_mpi", "mpi_bootstrap", "single_process", "PeerTable", "Topology",
    "check_hosts", "offered_addresses", "reachable_addresses",
]


def launched_by_mpi() -> bool:
    """True when an MPI launcher started this process."""
    return any(v in os.environ for v in MPI_LAUNCHER_VARIABLES)


def bootstrap(config: Config) -> PeerTable:
    """The peer table for this process, from whichever launcher started it."""
    table = rendezvous.from_env(config)  # KERAS_RING_RENDEZVOUS & co. win over MPI
    if table is not None:
        return table
    if launched_by_mpi():
        return mpi_bootstrap(config)
    return single_process()
