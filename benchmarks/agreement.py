"""What opening a collective costs with real processes: keras_ring.barrier() (a collective
that is only its agreement, called through the C API, so no TensorFlow dispatch is timed)
next to MPI_Barrier, and keras_ring's fast agreement against the full slot exchange.

Run with: mpirun -np 4 python benchmarks/agreement.py   (KERAS_RING_SHM=0 for TCP)
The fast agreement is switched by KERAS_RING_FAST_AGREE, read at init: this script re-runs
itself through the C API in one job by shutting down and initialising again with the
variable flipped, so both rows come from the same processes.
"""

from __future__ import annotations

import os

from mpi4py import MPI  # imported first: keras_ring then leaves MPI to this program

import keras_ring as kr  # noqa: E402

from _bench import timed  # noqa: E402


def main() -> None:
    comm = MPI.COMM_WORLD
    rows = []
    for fast in ("0", "1"):
        os.environ["KERAS_RING_FAST_AGREE"] = fast
        kr.init()
        # Ranks on other hosts are reached over TCP, those of this host over shared memory
        # (unless KERAS_RING_SHM=0).
        across = kr.local_size() < kr.size()
        transport = "tcp" if os.environ.get("KERAS_RING_SHM") == "0" or kr.local_size() == 1 \
            else ("tcp+shm" if across else "shm")
        t = timed(kr.barrier, 0, comm)
        kr.shutdown()
        rows.append((fast, t))
    mpi = timed(comm.Barrier, 0, comm)
    if comm.rank == 0:
        full, fast = rows[0][1], rows[1][1]
        print(f"# {comm.size} ranks, {os.cpu_count()} cores, {transport}; median us per barrier, "
              "the slowest rank's")
        print(f"{'ranks':>5} | {'transport':>9} | {'full exchange':>13} | {'fast agreement':>14} "
              f"| {'MPI_Barrier':>11}")
        print(f"{comm.size:>5} | {transport:>9} | {full * 1e6:13.1f} | {fast * 1e6:14.1f} "
              f"| {mpi * 1e6:11.1f}", flush=True)


if __name__ == "__main__":
    main()
