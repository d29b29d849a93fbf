"""Before and after the fast agreement and the size-aware allreduce, in one job: eager
keras_ring.allreduce with the full signature exchange and the ring only
(KERAS_RING_FAST_AGREE=0, as before issue 17) and with both (the defaults), next to MPICH's
MPI_Allreduce on the same buffers. The runtime is shut down and started again between
configurations (the settings are read at init) and the passes alternate old, new, old, new,
so each size shows two samples per configuration taken minutes apart on a noisy machine.

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
           "new": {"KERAS_RING_FAST_AGREE": "1", "KERAS_RING_DOUBLING_MAX_BYTES": ""}}


def one_pass(config: str, byte_sizes, comm) -> dict[int, tuple[float, float]]:
    """nbytes -> (keras_ring seconds, MPI_Allreduce seconds), under `config`."""
    for key, value in CONFIGS[config].items():
        if value:
            os.environ[key] = value
        else:
            os.environ.pop(key, None)
    kr.init()
    out = {}
    for nbytes in byte_sizes:
        host = np.random.default_rng(comm.rank).standard_normal(nbytes // 4).astype(np.float32)
        result = np.empty_like(host)
        tensor = tf.constant(host)
        ours = timed(lambda: kr.allreduce(tensor, op=kr.Sum), nbytes, comm)
        mpi = timed(lambda: comm.Allreduce(host, result, op=MPI.SUM), nbytes, comm)
        out[nbytes] = (ours, mpi)
    kr.shutdown()
    return out


def main() -> None:
    min_bytes, max_bytes = size_range(64 << 20)
    comm = MPI.COMM_WORLD
    transport = "tcp" if os.environ.get("KERAS_RING_SHM") == "0" else "shm"
    preamble(comm, f"float32 Sum, eager, {transport}")
    byte_sizes = list(sizes(min_bytes, max_bytes))
    passes = [(c, one_pass(c, byte_sizes, comm)) for c in ("old", "new", "old", "new")]
    if comm.rank == 0:
        print("# us per allreduce (two passes each, minutes apart); ratio = keras_ring / "
              "MPI_Allreduce of the same pass")
        print(f"{'bytes':>10} | {'old us':>15} | {'new us':>15} | {'MPI us':>15} | "
              f"{'old/MPI':>11} | {'new/MPI':>11}")
        for nbytes in byte_sizes:
            cell = {"old": [], "new": [], "mpi": [], "old/MPI": [], "new/MPI": []}
            for config, results in passes:
                ours, mpi = results[nbytes]
                cell[config].append(f"{ours * 1e6:.0f}")
                cell["mpi"].append(f"{mpi * 1e6:.0f}")
                cell[f"{config}/MPI"].append(f"{ours / mpi:.2f}")
            print(f"{nbytes:>10} | {' '.join(cell['old']):>15} | {' '.join(cell['new']):>15} | "
                  f"{' '.join(cell['mpi']):>15} | {' '.join(cell['old/MPI']):>11} | "
                  f"{' '.join(cell['new/MPI']):>11}", flush=True)


if __name__ == "__main__":
    main()
