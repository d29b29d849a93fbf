"""Adding and removing process sets (see keras_ring/process_sets.py): collectives over the
whole job that start or stop a set's runtime on its ranks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from keras_ring import peer_table
from keras_ring._errors_base import InitError, KerasRingError
from keras_ring.objects import allgather_object
from keras_ring.process_sets import ProcessSet
from keras_ring.runtime import RUNTIME


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Adds a process set; every rank of the job must call it, with the same ranks.

    Starts the set's runtime on its ranks (they connect to each other, bounded by
    ``KERAS_RING_TIMEOUT_SECONDS``) and returns the set with its ``process_set_id``. Sets made
    from mpi4py communicators may differ by rank where the communicators split the job
    (Horovod's ``ProcessSet(MPI.COMM_WORLD.Split(...))``): each part is then a set of its own,
    and each rank's object is the part it belongs to.

    Raises:
        ValueError: ranks out of range, a set with these ranks exists already, or ranks
            called it with different sets (on every rank alike).
    """
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    topology = RUNTIME.topology("keras_ring.add_process_set()")
    ranks, problem = _job_ranks(process_set)
    member = problem is None and topology.rank in ranks
    listener = peer_table.listen(len(set(topology.host_ids)) > 1, len(ranks)) if member else None
    try:
        offers = allgather_object((ranks, listener.getsockname()[1] if listener else None,
                                   process_set.from_comm, problem),
                                  name="keras_ring.add_process_set")
        parts = _parts(offers, topology.size)
        ids = _register(parts, offers, topology, listener)
    finally:
        if listener is not None:
            listener.close()
    process_set.ranks = list(ranks)
    process_set.world_ranks_given = False
    process_set.process_set_id = ids[parts.index(ranks)]
    process_set.split_ids = tuple(ids) if len(ids) > 1 else None
    return process_set


def _job_ranks(process_set: ProcessSet) -> tuple[tuple[int, ...], str | None]:
    """The set's ranks in this job, and what is wrong with them (None if nothing).

    A communicator's MPI_COMM_WORLD ranks are translated where ``init(comm=...)`` made the
    job a communicator's processes. A problem is raised after the ranks' offers are
    exchanged, so that every rank raises it, not only this one.
    """
    world = RUNTIME.world_ranks
    if world is None or not process_set.world_ranks_given:
        return tuple(process_set.ranks), None
    outside = [r for r in process_set.ranks if r not in world]
    if outside:
        return tuple(process_set.ranks), (
            f"its set's communicator holds MPI_COMM_WORLD ranks {outside}, which are not in "
            f"the communicator keras_ring.init(comm=...) was given (MPI_COMM_WORLD ranks "
            f"{world})")
    return tuple(sorted(world.index(r) for r in process_set.ranks)), None


def _register(parts: list[tuple[int, ...]], offers: list, topology: peer_table.Topology,
              listener: Any) -> list[int]:
    """Registers every part on every rank (the same ids everywhere) and starts this rank's
    own part's runtime; a start that failed anywhere is an error on every rank."""
    first = RUNTIME.next_process_set_id()
    ids = [first + k for k in range(len(parts))]
    error = None
    for k in sorted(range(len(parts)), key=lambda k: topology.rank in parts[k]):  # own last
        part, table = parts[k], None
        if topology.rank in part:
            table = peer_table.PeerTable(
                peer_table.Topology.from_host_ids(part.index(topology.rank),
                                                  [topology.host_ids[r] for r in part]),
                [(RUNTIME.member_address(r), offers[r][1]) for r in part],
                (RUNTIME.job_token * 1000003 + ids[k]) % (1 << 63), listener)
        try:
            RUNTIME.start_process_set(ids[k], part, table)
        except KerasRingError as e:
            error = str(e)
    failed = [(r, e) for r, e in enumerate(allgather_object(
        error, name="keras_ring.add_process_set.started")) if e]
    if failed:
        for set_id in ids:
            RUNTIME.stop_process_set(set_id)
        raise InitError(f"keras_ring.add_process_set: the set's runtime did not start on rank "
                        f"{failed[0][0]}: {failed[0][1]}")
    return ids


def _parts(offers: list, size: int) -> list[tuple[int, ...]]:
    """The sets to register: the one every rank offered, or the parts of a split.

    Every rank sees all offers, so every rank returns the same or raises the same error.
    """
    problems = [(r, offer[3]) for r, offer in enumerate(offers) if offer[3]]
    if problems:
        raise ValueError(f"keras_ring.add_process_set: on rank {problems[0][0]}, "
                         f"{problems[0][1]}")
    first = offers[0][0]
    differing = [r for r, offer in enumerate(offers) if offer[0] != first]
    if differing and not _is_split(offers):
        raise ValueError(f"keras_ring.add_process_set: ranks disagree about the set: rank 0 "
                         f"passed {list(first)}, rank {differing[0]} passed "
                         f"{list(offers[differing[0]][0])}; every rank must add the same sets "
                         "in the same order (or each a set made from its own part of a "
                         "communicator split)")
    parts = list(dict.fromkeys(offer[0] for offer in offers))
    for ranks in parts:
        if not ranks or ranks[0] < 0 or ranks[-1] >= size:
            raise ValueError(f"keras_ring.add_process_set: ranks {list(ranks)} are not a "
                             f"non-empty subset of the job's ranks 0..{size - 1}")
        if ranks in RUNTIME.process_set_ids().values():
            raise ValueError(f"keras_ring.add_process_set: a process set with ranks "
                             f"{list(ranks)} exists already")
    return parts


def _is_split(offers: list) -> bool:
    """Whether every rank offered a communicator's set that holds it, and the sets' members
    agree: the parts of a split, such as ``MPI.COMM_WORLD.Split(color=rank % 2)``'s."""
    return all(from_comm and rank in ranks and all(offers[m][0] == ranks for m in ranks)
               for rank, (ranks, _, from_comm, _) in enumerate(offers))


def remove_process_set(process_set: ProcessSet) -> bool:
    """Removes a process set (every rank calls it alike); False for the global set or one
    that was never added. Its runtime stops on its ranks."""
    RUNTIME.topology("keras_ring.remove_process_set()")
    set_id = process_set.process_set_id
    # The parts of a split are removed together, each rank naming its own part's set.
    split = getattr(process_set, "split_ids", None)
    ids = allgather_object(split or set_id, name="keras_ring.remove_process_set")
    if len(set(ids)) != 1:
        raise ValueError(f"keras_ring.remove_process_set: ranks disagree about the set to "
                         f"remove (process set ids by rank: {ids})")
    if set_id in (None, 0) or set_id not in RUNTIME.process_set_ids():
        return False
    for part_id in split or (set_id,):
        RUNTIME.stop_process_set(part_id)
    process_set.process_set_id = None
    process_set.split_ids = None
    return True


def add_at_init(process_sets: Sequence[ProcessSet]) -> None:
    """``init(process_sets=[...])``: adds each, in order, right after the job started."""
    for process_set in process_sets:
        add_process_set(process_set)
