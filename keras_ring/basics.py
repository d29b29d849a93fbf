"""Process-level API: init, shutdown and where this process sits in the job."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from keras_ring import _keras_private, _lifecycle
from keras_ring.process_sets import ProcessSet
from keras_ring.runtime import RUNTIME


def init(comm: Any = None, process_sets: Sequence[Any] | str | None = None) -> None:
    """Starts keras_ring in this process.

    Under ``mpirun -np N`` (or ``keras-ring-run``) it bootstraps through mpi4py and connects
    the ranks; a plain ``python train.py`` is a world of size 1 and needs no MPI. Calling it
    again while running does nothing (whatever ``comm`` it is given); after ``shutdown()`` it
    starts afresh.

    Args:
        comm: Horovod's: an mpi4py communicator whose processes form the job (its ranks
            become keras_ring's), or a list of ``MPI_COMM_WORLD`` ranks; None (the
            default) or an empty list: every process the launcher started. Each disjoint
            communicator is an independent job.
        process_sets: ``keras_ring.ProcessSet`` objects to add right away (every rank passes
            the same ones, or each its part of a communicator split), as
            ``add_process_set`` would. Horovod's ``"dynamic"`` (sets
            added and removed later) is accepted: keras_ring's sets always are.

    Example:

    ```python
    import keras_ring
    keras_ring.init()
    print(keras_ring.rank(), keras_ring.size())
    ```
    """
    _keras_private.check_supported()  # before anything starts: a too-old Keras or a JAX backend fails here
    _check_comm(comm)
    RUNTIME.init(comm=comm)
    for step in _lifecycle.AFTER_INIT:  # the Keras integration's, say: see keras_ring/__init__
        step()
    if process_sets == "dynamic":
        return
    if process_sets:
        for add in _lifecycle.ADD_PROCESS_SETS:
            add(list(process_sets))


def _check_comm(comm: Any) -> None:
    # keras_ring's init took process_sets first before it took Horovod's comm.
    if isinstance(comm, str) or (isinstance(comm, (list, tuple)) and any(
            isinstance(c, ProcessSet) for c in comm)):
        raise TypeError("keras_ring.init: the first argument is Horovod's comm (an mpi4py "
                        "communicator or a list of ranks); pass process sets by keyword: "
                        f"init(process_sets={comm!r})")


def shutdown() -> None:
    """Stops the runtime: its thread, sockets and shared resources. Also runs at exit."""
    RUNTIME.shutdown()


def is_initialized() -> bool:
    """True between ``init()`` and ``shutdown()``, also in a process forked from a rank:
    there ``rank()`` and ``size()`` answer for the rank, by which data loader workers shard
    (``rank() if is_initialized() else 0``), while ``init()`` and collectives raise."""
    return RUNTIME.initialized


def rank() -> int:
    """This process's rank in ``[0, size())``."""
    return RUNTIME.topology("keras_ring.rank()").rank


def size() -> int:
    """The number of processes in the job."""
    return RUNTIME.topology("keras_ring.size()").size


def local_rank() -> int:
    """This process's index among the processes on its host (use it to pick a GPU)."""
    return RUNTIME.topology("keras_ring.local_rank()").local_rank


def local_size() -> int:
    """The number of processes on this host."""
    return RUNTIME.topology("keras_ring.local_size()").local_size


def cross_rank() -> int:
    """The index of this process's host among the hosts (ranks with equal local_rank)."""
    return RUNTIME.topology("keras_ring.cross_rank()").cross_rank


def cross_size() -> int:
    """The number of hosts that have a process with this local_rank."""
    return RUNTIME.topology("keras_ring.cross_size()").cross_size
