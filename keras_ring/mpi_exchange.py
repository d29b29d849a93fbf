"""The exchange under an MPI launcher: host identities, addresses and a job token over
MPI_COMM_WORLD, through mpi4py (only for this exchange: MPI is not the data plane).

mpi4py is imported when the exchange runs, never at import: MPI is optional (``pip install
keras-ring[mpi]``), and a program launched otherwise must not load it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import numbers
import os
import secrets
import signal
import socket
import stat
import subprocess
import sys
from typing import Any

from keras_ring import interfaces
from keras_ring._errors_base import InitError
from keras_ring.config import Config, disagreement, must_agree
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
    if importlib.util.find_spec("mpi4py") is None:
        raise InitError("an MPI launcher started this process, but mpi4py is not installed: "
                        "pip install keras-ring[mpi] (or launch without MPI through the "
                        "KERAS_RING_RENDEZVOUS variables)")
    if user_owns_mpi:  # initialised by the program: every rank got that far
        from mpi4py import MPI
        return _exchange(MPI.COMM_WORLD, config)
    _check_launcher_connection()
    with _watchdog(config.timeout_seconds):
        return _exchange_and_finalize(config)


def _check_launcher_connection() -> None:
    """Raises where Hydra's variables name a connection (``PMI_FD``) this process does not
    hold: a child a rank started without passing its descriptors on (multiprocessing's
    ``spawn``) inherits the variables only, and MPI_Init there fails on the closed
    descriptor and kills the process with no Python error."""
    fd = os.environ.get("PMI_FD", "")
    if not fd.isdigit():
        return
    try:
        held = stat.S_ISSOCK(os.fstat(int(fd)).st_mode)
    except OSError:
        held = False
    if not held:
        raise InitError(
            f"this process has the variables of a rank that mpirun started (PMI_FD={fd}), but "
            "not that rank's connection to mpirun: a process the rank started without passing "
            "its descriptors on (multiprocessing's 'spawn' or 'forkserver' start method, or "
            "subprocess with close_fds=True) cannot start MPI. Call keras_ring.init() in the "
            "rank itself, or start the process with the 'fork' method, which keeps the connection "
            "(then only one of the two, the rank or its child, may call init())")


def comm_bootstrap(config: Config, comm: Any) -> PeerTable:
    """Horovod's ``init(comm=...)``: the job is an mpi4py communicator's processes, or these
    ``MPI_COMM_WORLD`` ranks (a list, in the order of their new ranks).

    Only the communicator's processes take part, so disjoint communicators make independent
    jobs. The exchange runs on a duplicate of the communicator (the program's own traffic on
    it is untouched) and is bounded like MPI_Init. MPI stays initialised afterwards, as in a
    program that brought it up itself: finalising it is collective over every process.
    """
    if importlib.util.find_spec("mpi4py") is None:
        raise InitError("init(comm=...) needs mpi4py: pip install keras-ring[mpi]")
    ranks = None if _is_communicator(comm) else _checked_ranks(comm)
    with _watchdog(config.timeout_seconds):  # MPI_Init and the exchange wait for the others
        from mpi4py import MPI

        if MPI.Is_finalized():
            raise InitError("init(comm=...): MPI was finalised after an earlier init() that "
                            "brought it up; import mpi4py before the first init(), or pass "
                            "comm to it")
        if ranks is not None:
            comm = _listed(MPI.COMM_WORLD, ranks)
        elif comm == MPI.COMM_NULL:
            raise ValueError("keras_ring.init: comm is MPI.COMM_NULL (this process's part of "
                             "a Split with color MPI.UNDEFINED): it belongs to no job")
        own = comm.Dup()
        try:
            return _exchange(own, config)
        finally:
            own.Free()
            if ranks is not None:
                comm.Free()


def _is_communicator(comm: Any) -> bool:
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and isinstance(comm, mpi.Intracomm):
        return True
    if isinstance(comm, (str, bytes)) or not hasattr(comm, "__iter__"):
        raise TypeError("keras_ring.init: comm must be an mpi4py intra-communicator or a list "
                        f"of MPI_COMM_WORLD ranks, got {type(comm).__module__}."
                        f"{type(comm).__qualname__}: {comm!r}")
    return False


def _checked_ranks(comm: Any) -> list[int]:
    ranks = list(comm)
    if any(not isinstance(r, numbers.Integral) or isinstance(r, bool) for r in ranks) or len(
            set(ranks)) != len(ranks):
        raise ValueError("keras_ring.init: comm as a list must hold distinct MPI_COMM_WORLD "
                         f"ranks (ints), got {comm!r}")
    return [int(r) for r in ranks]


def _listed(world: Any, ranks: list[int]) -> Any:
    """The communicator of these MPI_COMM_WORLD ranks (this process among them)."""
    outside = [r for r in ranks if not 0 <= r < world.Get_size()]
    if outside:
        raise ValueError(f"keras_ring.init: comm={ranks} names ranks {outside}, but "
                         f"MPI_COMM_WORLD has ranks 0..{world.Get_size() - 1}")
    if world.Get_rank() not in ranks:
        raise ValueError(f"keras_ring.init: comm={ranks} leaves out this process "
                         f"(MPI_COMM_WORLD rank {world.Get_rank()}); only the listed ranks "
                         "call init with it")
    everyone = world.Get_group()
    group = everyone.Incl(ranks)
    try:  # collective over the group's processes only, so the others need not be here
        return world.Create_group(group)
    finally:
        group.Free()
        everyone.Free()


def whole_world(comm: Any) -> bool:
    """Whether ``comm`` is the job the launcher started (found then as without ``comm``, so
    also through keras-ring-run's rendezvous, where each process's MPI_COMM_WORLD is itself
    alone): an mpi4py communicator of MPI_COMM_WORLD's processes in their order, or an empty
    list (Horovod's default)."""
    if isinstance(comm, (list, tuple)) and not comm:
        return True
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not isinstance(comm, mpi.Intracomm) or comm == mpi.COMM_NULL:
        return False
    return mpi.Comm.Compare(comm, mpi.COMM_WORLD) in (mpi.IDENT, mpi.CONGRUENT)


def world_ranks_of(comm: Any) -> list[int]:
    """The MPI_COMM_WORLD ranks of ``comm``'s processes, in its rank order."""
    from mpi4py import MPI

    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return list(MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world))
    finally:
        group.Free()
        world.Free()


def _world_ranks(comm: Any) -> list[int] | None:
    """Each of ``comm``'s ranks in MPI_COMM_WORLD; None if they are MPI_COMM_WORLD's."""
    from mpi4py import MPI

    ranks = world_ranks_of(comm)
    return None if ranks == list(range(MPI.COMM_WORLD.Get_size())) else ranks


def _exchange_and_finalize(config: Config) -> PeerTable:
    from mpi4py import MPI  # MPI_Init, as mpi4py imports it

    try:
        return _exchange(MPI.COMM_WORLD, config)
    finally:
        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.Finalize()


# Under MPICH, MPI_Init waits for every rank to start MPI, holding Python's lock: a rank that
# failed before init() (a bad variable, a missing file) leaves the others there for ever
# under plain mpirun, where nothing in this process can run. A small process outside ends
# this one, saying why, if the exchange has not returned within the timeout. Its input is a
# pipe from this rank, so it learns at once when the rank is gone (killed by mpirun, say) and
# leaves instead of holding mpirun's output open. MPICH removes its shared-memory segment
# only once every local rank has attached: the watchdog removes the one this rank holds, or
# each failed start would leave 2 MiB in /dev/shm.
_WATCHDOG = """
outlived() {  # true when the rank is still there after $1 s
  if command -v timeout >/dev/null; then timeout "$1" cat >/dev/null; [ $? -eq 124 ]
  else sleep "$1"; fi  # an unusual timeout sleep refuses: unbounded, as MPI is
}
outlived "$1" || exit 0
echo "keras_ring: InitError on rank $3: not every rank reached keras_ring.init() within $4 s \
(KERAS_RING_TIMEOUT_SECONDS): a rank failed or is still busy before init(); its own output \
says why. Ending this rank." >&2
for fd in /proc/"$2"/fd/*; do
  case $(readlink "$fd") in /dev/shm/mpich_shm_*) rm -f "$(readlink "$fd")";; esac
done
kill -TERM "$2"; outlived 5 && kill -KILL "$2"
"""


@contextlib.contextmanager
def _watchdog(timeout_seconds: float):
    rank = os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or "?"
    try:
        # A session of its own, killed whole: its sleep must not outlive it holding our
        # stderr, which mpirun reads to the end before it exits.
        guard = subprocess.Popen(["sh", "-c", _WATCHDOG, "keras_ring-watchdog",
                                  f"{timeout_seconds:.3f}", str(os.getpid()), rank,
                                  f"{timeout_seconds:g}"],
                                 stdin=subprocess.PIPE, close_fds=True, start_new_session=True)
    except OSError:  # no shell: unbounded, as MPI itself is
        yield
        return
    try:
        yield
    finally:
        try:
            os.killpg(guard.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        guard.wait()
        guard.stdin.close()


def _exchange(comm, config: Config) -> PeerTable:
    rank, size = comm.Get_rank(), comm.Get_size()
    host_id = config.host_id or socket.gethostname()
    claims = comm.allgather((host_id, interfaces.network_stack_id(), must_agree(config)))
    host_ids = [h for h, _, _ in claims]
    problem = (disagreement([c for _, _, c in claims])
               or check_hosts(host_ids, [s for _, s, _ in claims]))
    if problem:  # every rank sees the same claims, so every rank raises this
        raise InitError(problem)
    topology = Topology.from_host_ids(rank, host_ids)
    world_ranks = _world_ranks(comm)
    if size == 1:
        return PeerTable(topology, via_mpi=True, world_ranks=world_ranks)
    multi_host = len(set(host_ids)) > 1
    listener = listen(multi_host, size)
    try:
        offered, why = offered_addresses(config) if multi_host else ("127.0.0.1", None)
        entries = comm.allgather((offered, why, listener.getsockname()[1]))
        for r, (_, error, _) in enumerate(entries):
            if error:
                raise InitError(f"rank {r} (host '{host_ids[r]}'): {error}")
        addresses = reachable_addresses(rank, host_ids, [s for _, s, _ in claims],
                                        [a for a, _, _ in entries], [p for _, _, p in entries])
        token = comm.bcast(secrets.randbits(63) if rank == 0 else None, root=0)
    except BaseException:
        listener.close()
        raise
    return PeerTable(topology, addresses, token, listener, via_mpi=True, world_ranks=world_ranks)
