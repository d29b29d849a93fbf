"""Process sets: collectives among a subset of the ranks (Horovod's names and semantics).

Each set has a runtime of its own on its member ranks (its own connections, ring, signature
checks and bounded waits, and on GPUs its own NCCL communicator), started by
``add_process_set`` (keras_ring/process_set_setup.py), which every rank calls alike. A collective with
``process_set=`` runs only among the set's ranks; a rank outside it gets a ``ValueError``.
Ranks in arguments (``root_rank``) stay global, as in Horovod; ``ProcessSet.rank()`` is the
rank within the set.

Example:

```python
keras_ring.init()
evens = keras_ring.add_process_set([0, 2])
if evens.included():
    x = keras_ring.allreduce(x, process_set=evens)
```
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from keras_ring.mpi_exchange import world_ranks_of
from keras_ring.runtime import RUNTIME


class ProcessSet:
    """A subset of the ranks that runs collectives together.

    Args:
        ranks_or_comm: the global ranks of the set, or an mpi4py communicator whose
            processes form it (after ``init(comm=...)``, as ranks of that communicator).

    Example:

    ```python
    stage = keras_ring.ProcessSet([0, 1])
    keras_ring.init(process_sets=[stage])
    ```
    """

    def __init__(self, ranks_or_comm: Sequence[int] | Any) -> None:
        self.process_set_id: int | None = None
        # Made from a communicator: its ranks may differ by rank (the parts of a split),
        # and they are MPI_COMM_WORLD's until added (then the job's own).
        self.from_comm = hasattr(ranks_or_comm, "Get_group")
        self.world_ranks_given = self.from_comm
        # The ids of every part where the set is a split (see add_process_set), else None.
        self.split_ids: tuple[int, ...] | None = None
        if self.from_comm:  # an mpi4py communicator
            ranks_or_comm = _world_ranks_of(ranks_or_comm)
        if not isinstance(ranks_or_comm, Iterable) or isinstance(ranks_or_comm, (str, bytes)):
            raise ValueError("ProcessSet takes a list of ranks or an mpi4py communicator, got "
                             f"{type(ranks_or_comm).__name__}")
        ranks = list(ranks_or_comm)
        if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
            raise ValueError(f"ProcessSet ranks must be ints, got {ranks!r}")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ProcessSet ranks must be distinct, got {ranks!r}")
        self.ranks: list[int] = sorted(ranks)

    def members(self) -> list[int]:
        """The set's global ranks: every rank of the job for the global set (after init())."""
        return self.ranks or list(range(RUNTIME.topology().size))

    def size(self) -> int | None:
        """The number of ranks in the set (None before it is added)."""
        return None if self.process_set_id is None else len(self._entry()[0])

    def rank(self) -> int | None:
        """This process's rank within the set (None before it is added, or outside it)."""
        if self.process_set_id is None:
            return None
        topology = self._entry()[1]
        return None if topology is None else topology.rank

    def included(self) -> bool | None:
        """Whether this process is one of the set's ranks (None before ``init()``)."""
        if not RUNTIME.initialized:
            return None
        if self.world_ranks_given and RUNTIME.world_ranks is not None:  # not added yet
            return RUNTIME.world_ranks[RUNTIME.topology().rank] in self.ranks
        return RUNTIME.topology().rank in self.ranks  # the registered ranks are these

    def _entry(self):
        return RUNTIME.process_set(self.process_set_id, "ProcessSet")

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


def _world_ranks_of(comm: Any) -> list[int]:
    """The MPI_COMM_WORLD ranks of ``comm``'s processes, in its rank order."""
    from mpi4py import MPI

    if comm == MPI.COMM_NULL:
        raise ValueError("ProcessSet got MPI.COMM_NULL (this process's part of a Split with "
                         "color MPI.UNDEFINED): a set needs a communicator this process is in")
    return world_ranks_of(comm)


class _GlobalProcessSet(ProcessSet):
    """All ranks of the job: id 0, its ranks known once ``init()`` ran."""

    def __init__(self) -> None:
        super().__init__([])
        self.process_set_id = 0

    @property  # type: ignore[override]
    def ranks(self) -> list[int]:
        return list(RUNTIME.process_set(0)[0]) if RUNTIME.initialized else []

    @ranks.setter
    def ranks(self, value: list[int]) -> None:
        pass  # always all ranks


global_process_set: ProcessSet = _GlobalProcessSet()


def resolve(process_set: ProcessSet | None, what: str) -> int:
    """The id of the runtime a collective with ``process_set=`` runs on, once checked."""
    if process_set is None or process_set is global_process_set:
        RUNTIME.topology(f"keras_ring.{what}()")
        return 0
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"keras_ring.{what}: process_set must be a keras_ring.ProcessSet, got "
                        f"{type(process_set).__name__}")
    if process_set.process_set_id is None:
        raise ValueError(f"keras_ring.{what}: {process_set} has not been added; call "
                         "keras_ring.add_process_set on every rank first")
    ranks, topology = RUNTIME.process_set(process_set.process_set_id, f"keras_ring.{what}()")
    if topology is None:
        raise ValueError(f"keras_ring.{what}: rank {RUNTIME.topology().rank} is not in "
                         f"{process_set}; only its ranks may run its collectives")
    return process_set.process_set_id


def set_rank(set_id: int) -> int:
    """This rank's rank within process set ``set_id`` (which it belongs to)."""
    topology = RUNTIME.process_set(set_id)[1]
    assert topology is not None
    return topology.rank


def set_size(set_id: int) -> int:
    return len(RUNTIME.process_set(set_id)[0])


# Signature::kRootNotInSet (keras_ring/ops/cc/core/signature.h): roots at or below it name a
# global rank outside the set, encoded as ROOT_NOT_IN_SET - rank.
ROOT_NOT_IN_SET = -(2**30)


def root_in_set(root_rank: int, set_id: int) -> int:
    """A global ``root_rank`` as the set's rank (Horovod takes roots as global ranks)."""
    if set_id == 0:
        return root_rank
    ranks = RUNTIME.process_set(set_id)[0]
    if root_rank in ranks:
        return ranks.index(root_rank)
    # Passed on for the runtime to report on every member alike (CheckSignatures), rather
    # than raised here on this rank alone while the others wait for its data.
    if root_rank < 0:
        return max(root_rank, ROOT_NOT_IN_SET + 1)  # out of range in any numbering
    return ROOT_NOT_IN_SET - min(root_rank, 2**30)
