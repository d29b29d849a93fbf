"""Definitions that must agree where one copy cannot serve: the launcher variables of the
package and of keras-ring-run's per-rank wrapper (a stdlib-only script that cannot import
keras_ring)."""

from keras_ring import config, launcher


def test_the_rank_wrapper_reads_the_same_rank_variables():
    assert launcher._RANK_VARIABLES == config.RANK_VARIABLES


def test_a_child_without_mpi_prefixed_variables_is_no_mpi_rank():
    # The tests start children without these prefixes: bootstrap.launched_by_mpi() must be
    # False there.
    assert all(v.startswith(config.MPI_VARIABLE_PREFIXES) for v in config.MPI_LAUNCHER_VARIABLES)
