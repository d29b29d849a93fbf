"""Parallel tests: every rank runs this same pytest session under one mpirun.

Every rank must run the same tests in the same order (collectives pair up by order), so
tests never skip or branch on rank in ways that change which collectives run.
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
