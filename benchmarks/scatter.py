"""nccl-tests-style tables for reducescatter and alltoall: keras_ring (eager; inside a
tf.function) next to MPICH (through mpi4py) on the same buffers, in the same run.

Run with: mpirun -np 2 python benchmarks/scatter.py [--min-bytes 4096] [--max-bytes 67108864]
"bytes" is each rank's input (a float32 vector); each rank's output is 1/n of it. Columns per
implementation: the median time of one collective (the slowest rank's), algbw = input bytes /
time and busbw = algbw * (n-1)/n (nccl-tests' convention for both collectives), in GB/s.

reducescatter (Sum): keras_ring, the same call in a tf.function, MPI_Reduce_scatter with
keras_ring's split (equal recvcounts when n divides the rows); then keras_ring's allreduce of
the same tensor and "rs/ar", reducescatter time / allreduce time (a ring reduce-scatter is
the first half of a ring allreduce, so about 0.5 is the goal), and the same two for MPICH.

alltoall: keras_ring with explicit equal splits (the MPI_Alltoallv analogue; it also returns
the received splits), the same in a tf.function, and MPI_Alltoallv with the same counts.

Before timing, each size checks once that keras_ring's results equal MPICH's.
"""

from __future__ import annotations

import numpy as np

from mpi4py import MPI  # imported first: keras_ring then leaves MPI to this program

import tensorflow as tf  # noqa: E402

import keras_ring as kr  # noqa: E402
from keras_ring.scatter import reducescatter_rows  # noqa: E402

from _bench import (bw_cell, header, preamble, ratio_cell, size_range, sizes,  # noqa: E402
                    time_cell, timed)


def _input(nbytes: int, comm) -> np.ndarray:
    # Different values per rank, so a wrong reduction or a wrong part cannot pass the check.
    return np.random.default_rng(comm.rank).standard_normal(nbytes // 4).astype(np.float32)


def _shares(count: int, size: int) -> list[int]:
    """Elements per rank, keras_ring's split (which MPICH is given too)."""
    return [reducescatter_rows(count, size, r) for r in range(size)]


def _check(name: str, got, want: np.ndarray, exact: bool) -> None:
    got = np.asarray(got)
    if exact:
        np.testing.assert_array_equal(got, want, err_msg=name)
    else:  # the sum's order differs between the two rings
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=name)


def reducescatter_row(nbytes: int, comm) -> str:
    """One row of the reducescatter table: the cells after the bytes column."""
    host = _input(nbytes, comm)
    counts = _shares(host.size, comm.size)
    mpi_out = np.empty(counts[comm.rank], np.float32)
    mpi_full = np.empty_like(host)
    tensor = tf.constant(host)

    # The tensor is captured, as a training step's gradients are: this times the collective,
    # not TensorFlow's conversion of a Python argument per call.
    @tf.function(autograph=False)
    def in_graph():
        return kr.reducescatter(tensor, op=kr.Sum)

    impls = {
        "keras_ring": lambda: kr.reducescatter(tensor, op=kr.Sum),
        "tf.function": in_graph,
        "MPI_Reduce_scatter": lambda: comm.Reduce_scatter(host, mpi_out, counts, op=MPI.SUM),
        "allreduce": lambda: kr.allreduce(tensor, op=kr.Sum),
        "MPI_Allreduce": lambda: comm.Allreduce(host, mpi_full, op=MPI.SUM),
    }
    impls["MPI_Reduce_scatter"]()
    _check("reducescatter", impls["keras_ring"](), mpi_out, exact=False)
    _check("reducescatter in tf.function", in_graph(), mpi_out, exact=False)
    t = {name: timed(fn, nbytes, comm) for name, fn in impls.items()}
    bus = (comm.size - 1) / comm.size
    return (bw_cell(t["keras_ring"], nbytes, bus) + bw_cell(t["tf.function"], nbytes, bus)
            + bw_cell(t["MPI_Reduce_scatter"], nbytes, bus) + time_cell(t["allreduce"])
            + ratio_cell(t["keras_ring"] / t["allreduce"]) + time_cell(t["MPI_Allreduce"])
            + ratio_cell(t["MPI_Reduce_scatter"] / t["MPI_Allreduce"]))


REDUCESCATTER_COLUMNS = [("keras_ring", "bw"), ("tf.function", "bw"), ("MPI_Reduce_scatter", "bw"),
                         ("allreduce", "time"), ("rs/ar", "ratio"), ("MPI_Allreduce", "time"),
                         ("MPI rs/ar", "ratio")]


def alltoall_row(nbytes: int, comm) -> str:
    """One row of the alltoall table: the cells after the bytes column."""
    host = _input(nbytes, comm)
    n = comm.size
    # Every rank sends the same split (near-equal when n does not divide the rows), so rank
    # r receives splits[r] rows from each peer.
    splits = _shares(host.size, n)
    send_at = np.concatenate([[0], np.cumsum(splits)[:-1]])
    recv = [splits[comm.rank]] * n
    recv_at = [i * splits[comm.rank] for i in range(n)]
    mpi_out = np.empty(sum(recv), np.float32)
    tensor = tf.constant(host)

    @tf.function(autograph=False)
    def in_graph():
        return kr.alltoall(tensor, splits=splits)

    impls = {
        "keras_ring": lambda: kr.alltoall(tensor, splits=splits),
        "tf.function": in_graph,
        "MPI_Alltoallv": lambda: comm.Alltoallv([host, (splits, send_at), MPI.FLOAT],
                                                [mpi_out, (recv, recv_at), MPI.FLOAT]),
    }
    impls["MPI_Alltoallv"]()
    for name in ("keras_ring", "tf.function"):
        out, received = impls[name]()
        _check(f"alltoall {name}", out, mpi_out, exact=True)
        _check(f"alltoall {name} received splits", received, np.asarray(recv), exact=True)
    bus = (n - 1) / n
    return "".join(bw_cell(timed(fn, nbytes, comm), nbytes, bus) for fn in impls.values())


ALLTOALL_COLUMNS = [("keras_ring", "bw"), ("tf.function", "bw"), ("MPI_Alltoallv", "bw")]


def table(title: str, columns, row, span: tuple[int, int], comm) -> None:
    if comm.rank == 0:
        print(f"\n## {title}")
        print(header(columns), flush=True)
    for nbytes in sizes(*span):
        cells = row(nbytes, comm)
        if comm.rank == 0:
            print(f"{nbytes:>11}{cells}", flush=True)


def main() -> None:
    span = size_range(64 << 20)
    kr.init()
    comm = MPI.COMM_WORLD
    preamble(comm, "float32")
    table("reducescatter (Sum); busbw = algbw * (n-1)/n; rs/ar = reducescatter / allreduce time",
          REDUCESCATTER_COLUMNS, reducescatter_row, span, comm)
    table("alltoall (equal splits); busbw = algbw * (n-1)/n", ALLTOALL_COLUMNS, alltoall_row,
          span, comm)
    kr.shutdown()


if __name__ == "__main__":
    main()
