"""Parallel tests: every rank runs this same pytest session under one mpirun.

Every rank must run the same tests in the same order (collectives pair up by order), so
tests never skip or branch on rank in ways that change which collectives run. Each test
starts with every rank together (the in_step fixture below), so that one failure stays one.
"""

import os

import pytest

import keras_ring


def pytest_configure(config):
    if "PMI_RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ:
        raise pytest.UsageError("tests/parallel must run under mpirun, e.g. "
                                "'.venv/bin/mpirun -np 2 .venv/bin/python -m pytest tests/parallel'")
    keras_ring.init()
    if keras_ring.size() < 2:  # the tests compare ranks and make them disagree
        raise pytest.UsageError("tests/parallel needs at least 2 ranks, got a world of one; "
                                "run it under 'mpirun -np 2' or more")


@pytest.fixture(scope="session")
def world():
    """(rank, size) of this process."""
    return keras_ring.rank(), keras_ring.size()


# --- every rank starts each test together -------------------------------------------------
#
# A test that fails on one rank before its collectives (a local exception) leaves that rank a
# test ahead: without a resync, every later test would pair its collectives with the wrong
# test's and fail too, hiding the one failure that matters. Each test therefore opens with one
# allgather of its position (and a checksum of its id, so that ranks that collected different
# tests say so). A rank that is behind fails this test at setup, naming where the others are,
# and meets them at the next; ranks that are ahead wait. Each round is a collective, so every
# wait is bounded by KERAS_RING_TIMEOUT_SECONDS like any other.

_POSITIONS: dict[str, int] = {}
_RESYNC_ROUNDS = 1000  # far more tests than any gap; a bound, never reached in a sound run


def pytest_collection_modifyitems(session, config, items):
    _POSITIONS.update((item.nodeid, i) for i, item in enumerate(items))


def _positions(position: int, checksum: int):
    """Every rank's (position, checksum); a mismatch with a collective that a failed test on
    another rank left waiting is retried: that rank has now abandoned it too."""
    import tensorflow as tf

    mine = tf.constant([[position, checksum]], tf.int64)
    for attempt in range(3):
        try:
            return keras_ring.allgather(mine, name="tests.in_step").numpy()
        except keras_ring.CollectiveMismatchError:
            if attempt == 2:
                raise


@pytest.fixture(autouse=True)
def in_step(request):
    import zlib

    position = _POSITIONS[request.node.nodeid]
    checksum = zlib.crc32(request.node.nodeid.encode())
    for _ in range(_RESYNC_ROUNDS):
        everyone = _positions(position, checksum)
        ahead = int(everyone[:, 0].max())
        if (everyone[:, 0] == position).all():
            if not (everyone[:, 1] == checksum).all():
                pytest.fail(f"the ranks collected different tests at position {position} "
                            f"(this rank: {request.node.nodeid})", pytrace=False)
            break
        if position < ahead:
            leaders = [r for r, p in enumerate(everyone[:, 0]) if p == ahead]
            pytest.fail(f"not run on this rank: rank(s) {leaders} already went on to a later "
                        "test, after a failure left the ranks out of step", pytrace=False)
    yield
