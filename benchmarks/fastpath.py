"""Before and after the fast agreement and the size-aware allreduce, in one job: eager
keras_ring.allreduce with the defaults ("new": fast agreement, recursive doubling up to
KERAS_RING_DOUBLING_MAX_BYTES, ring above) and with the settings of before issue 17 ("old":
KERAS_RING_FAST_AGREE=0, every collective opens with the full signature exchange, then the
ring), next to MPICH's MPI_Allreduce on the same buffers. The settings are read at init, so
for each size the runtime is started again per configuration, alternating old, new three
times; MPI_Allreduce is timed right after each, and each cell shows the three samples'
range, so the machine's noise shows instead of hiding in one number.

Run with: mpirun -np 2 python benchmarks/fastpath.py [--max-bytes N]  (KERAS_RING_SHM=0: TCP)
"""

from __future__ import annotations

import os

import numpy as np

from mpi4py import MPI  # imported first: keras_ring then leaves MPI to this program

import tensorflow as tf  # noqa: E402

import keras_ring as kr  # noqa: E402

from _bench import preamble, size_range, sizes, timed  # noqa: E402


CONFIGS = {"old": {"KERAS_RING_FAST_AGREE": "0", "KERAS_RING_DOUBLING_MAX_BYTES": "0"},
           "new": {"KERAS_RING_FAST_AGREE": "1", "KERAS_RING_DOUBLING_MAX_BYTES": None}}


def sample(config: str, nbytes: int, comm) -> tuple[float, float]:
    """(keras_ring seconds, MPI_Allreduce seconds) with a runtime started under `config`."""
    for key, value in CONFIGS[config].items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    kr.init()
    host = np.random.default_rng(comm.rank).standard_normal(nbytes // 4).astype(np.float32)
    result = np.empty_like(host)
    tensor = tf.constant(host)
    ours = timed(lambda: kr.allreduce(tensor, op=kr.Sum), nbytes, comm)
    mpi = timed(lambda: comm.Allreduce(host, result, op=MPI.SUM), nbytes, comm)
    kr.shutdown()
    return ours, mpi


def span(values) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.0f}-{hi:.0f}" if lo >= 10 else f"{lo:.2f}-{hi:.2f}"


def main() -> None:
    min_bytes, max_bytes = size_range(64 << 20)
    comm = MPI.COMM_WORLD
    transport = "tcp" if os.environ.get("KERAS_RING_SHM") == "0" else "shm"
    preamble(comm, f"float32 Sum, eager, {transport}")
    if comm.rank == 0:
        print("# us per allreduce: range of 3 samples per configuration, alternating; ratios "
              "against the MPI_Allreduce timed right after each")
        print(f"{'bytes':>10} | {'old us':>11} | {'new us':>11} | {'MPI us':>11} | "
              f"{'old/MPI':>11} | {'new/MPI':>11}", flush=True)
    for nbytes in sizes(min_bytes, max_bytes):
        got = {"old": [], "new": []}
        for _ in range(3):
            for config in ("old", "new"):
                got[config].append(sample(config, nbytes, comm))
        if comm.rank == 0:
            cells = [span([o * 1e6 for o, _ in got["old"]]),
                     span([n * 1e6 for n, _ in got["new"]]),
                     span([m * 1e6 for _, m in got["old"] + got["new"]]),
                     span([o / m for o, m in got["old"]]),
                     span([n / m for n, m in got["new"]])]
            print(f"{nbytes:>10} | " + " | ".join(f"{c:>11}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
