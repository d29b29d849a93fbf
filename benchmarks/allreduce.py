"""nccl-tests-style allreduce table: keras_ring (eager; one tensor in a tf.function; 64 tensors
grouped in one tf.function) next to MPICH's MPI_Allreduce (through mpi4py) on the same buffers,
in the same run.

Run with: mpirun -np 2 python benchmarks/allreduce.py [--max-bytes 268435456]
Columns: bytes per rank, then per implementation the median time of one allreduce, algbw
(bytes / time) and busbw (algbw * 2(n-1)/n, the traffic each rank's link carries), in GB/s.
The last three columns give times only: one tensor allreduced in a tf.function (the call's own
overhead), the grouped collective with its results consumed inside the graph (as in a training
step) instead of returned to Python, and "TF alone x64", no collective at all: the same
tf.function call returning 64 fresh tensors (tf.math.negative of each part), i.e. what
TensorFlow itself costs the grouped column.
"""

from __future__ import annotations

import numpy as np

from mpi4py import MPI  # imported first: keras_ring then leaves MPI to this program

import tensorflow as tf  # noqa: E402

import keras_ring as kr  # noqa: E402

from _bench import (bw_cell, header, only_columns, preamble, size_range, sizes,  # noqa: E402
                    time_cell, timed)

GROUPED_TENSORS = 64


def implementations(nbytes: int, comm):
    """name -> (callable, whether its bandwidth means anything)."""
    count = nbytes // 4
    rng = np.random.default_rng(comm.rank)
    host = rng.standard_normal(count).astype(np.float32)
    out = np.empty_like(host)
    tensor = tf.constant(host)
    parts = [tf.constant(p) for p in np.array_split(host, GROUPED_TENSORS)]

    # The tensors are captured, as gradients are made inside a training step: this times the
    # collective, not TensorFlow's marshalling of 64 Python arguments per call.
    @tf.function(autograph=False)
    def grouped():
        return kr.grouped_allreduce(parts, op=kr.Sum)

    # As in a training step: the results are consumed inside the graph, not returned to Python
    # (the stateful op still runs to completion before the call returns).
    @tf.function(autograph=False)
    def grouped_in_graph():
        kr.grouped_allreduce(parts, op=kr.Sum)

    @tf.function(autograph=False)
    def single():
        return kr.allreduce(tensor, op=kr.Sum)

    @tf.function(autograph=False)
    def tf_alone():
        return [tf.math.negative(p) for p in parts]

    return {
        "keras_ring": (lambda: kr.allreduce(tensor, op=kr.Sum), True),
        f"grouped x{GROUPED_TENSORS}": (grouped, True),
        "MPI_Allreduce": (lambda: comm.Allreduce(host, out, op=MPI.SUM), True),
        "tf.function x1": (single, False),
        "x64 in graph": (grouped_in_graph, False),
        f"TF alone x{GROUPED_TENSORS}": (tf_alone, False),
    }


def chosen(nbytes: int, comm, only: list[str]):
    impls = implementations(nbytes, comm)
    return {k: v for k, v in impls.items() if not only or k in only}


def main() -> None:
    min_bytes, max_bytes = size_range(256 << 20)
    only = only_columns(256 << 20)
    kr.init()
    comm = MPI.COMM_WORLD
    n = comm.size
    preamble(comm, "float32 Sum")
    if comm.rank == 0:
        impls = chosen(4096, comm, only)
        print(header([(name, "bw" if bw else "time") for name, (_, bw) in impls.items()]))
    for nbytes in sizes(min_bytes, max_bytes):
        cells = ""
        for fn, bw in chosen(nbytes, comm, only).values():
            t = timed(fn, nbytes, comm)
            cells += bw_cell(t, nbytes, 2 * (n - 1) / n) if bw else time_cell(t)
        if comm.rank == 0:
            print(f"{nbytes:>11}{cells}", flush=True)
    kr.shutdown()


if __name__ == "__main__":
    main()
