"""Adding and removing process sets (see keras_ring/process_sets.py): collectives over the
whole job that start or stop a set's runtime on its ranks."""

from __future__ import annotations

from collections.abc import Sequence

from keras_ring import peer_table
from keras_ring.objects import allgather_object
from keras_ring.process_sets import ProcessSet
from keras_ring.runtime import RUNTIME


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Adds a process set; every rank of the job must call it, with the same ranks.

    Starts the set's runtime on its ranks (they connect to each other, bounded by
    ``KERAS_RING_TIMEOUT_SECONDS``) and returns the set with its ``process_set_id``.

    Raises:
        ValueError: ranks out of range, a set with these ranks exists already, or ranks
            called it with different sets (on every rank alike).
    """
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    topology = RUNTIME.topology("keras_ring.add_process_set()")
    ranks = _job_ranks(process_set)
    member = topology.rank in ranks
    listener = peer_table.listen(len(set(topology.host_ids)) > 1, len(ranks)) if member else None
    try:
        offers = allgather_object((ranks, listener.getsockname()[1] if listener else None))
        _check_same_set(offers, topology.size, ranks)
        set_id = RUNTIME.next_process_set_id()
        table = None
        if member:
            host_ids = [topology.host_ids[r] for r in ranks]
            table = peer_table.PeerTable(
                peer_table.Topology.from_host_ids(ranks.index(topology.rank), host_ids),
                [(RUNTIME.member_address(r), offers[r][1]) for r in ranks],
                (RUNTIME.job_token * 1000003 + set_id) % (1 << 63), listener)
        RUNTIME.start_process_set(set_id, ranks, table)
    finally:
        if listener is not None:
            listener.close()
    process_set.process_set_id = set_id
    return process_set


def _job_ranks(process_set: ProcessSet) -> tuple[int, ...]:
    """The set's ranks in this job: a communicator's MPI_COMM_WORLD ranks translated where
    ``init(comm=...)`` made the job a communicator's processes."""
    world = RUNTIME.world_ranks
    if world is None or not getattr(process_set, "world_ranks_given", False):
        return tuple(process_set.ranks)
    outside = [r for r in process_set.ranks if r not in world]
    if outside:
        raise ValueError(f"keras_ring.add_process_set: the set's communicator holds "
                         f"MPI_COMM_WORLD ranks {outside}, which are not in the communicator "
                         f"keras_ring.init(comm=...) was given (MPI_COMM_WORLD ranks {world})")
    process_set.ranks = sorted(world.index(r) for r in process_set.ranks)
    process_set.world_ranks_given = False
    return tuple(process_set.ranks)


def _check_same_set(offers: list, size: int, ranks: tuple[int, ...]) -> None:
    """Every rank sees all offers, so every rank raises the same error."""
    differing = [r for r, (theirs, _) in enumerate(offers) if theirs != offers[0][0]]
    if differing:
        raise ValueError(f"keras_ring.add_process_set: ranks disagree about the set: rank 0 "
                         f"passed {list(offers[0][0])}, rank {differing[0]} passed "
                         f"{list(offers[differing[0]][0])}; every rank must add the same sets "
                         "in the same order")
    if not ranks or ranks[0] < 0 or ranks[-1] >= size:
        raise ValueError(f"keras_ring.add_process_set: ranks {list(ranks)} are not a non-empty "
                         f"subset of the job's ranks 0..{size - 1}")
    if ranks in RUNTIME.process_set_ids().values():
        raise ValueError(f"keras_ring.add_process_set: a process set with ranks {list(ranks)} "
                         "exists already")


def remove_process_set(process_set: ProcessSet) -> bool:
    """Removes a process set (every rank calls it alike); False for the global set or one
    that was never added. Its runtime stops on its ranks."""
    RUNTIME.topology("keras_ring.remove_process_set()")
    set_id = process_set.process_set_id
    ids = allgather_object(set_id)
    if len(set(ids)) != 1:
        raise ValueError(f"keras_ring.remove_process_set: ranks disagree about the set to "
                         f"remove (process set ids by rank: {ids})")
    if set_id in (None, 0) or set_id not in RUNTIME.process_set_ids():
        return False
    RUNTIME.stop_process_set(set_id)
    process_set.process_set_id = None
    return True


def add_at_init(process_sets: Sequence[ProcessSet]) -> None:
    """``init(process_sets=[...])``: adds each, in order, right after the job started."""
    for process_set in process_sets:
        add_process_set(process_set)
