"""Issue 17's yardstick: keras_ring's allreduce in graph mode and eager against MPICH's
MPI_Allreduce on the same buffers, every size from 4 KiB, rounds interleaved in one job.

"graph" is the time per allreduce of K allreduces of one captured tensor inside one
tf.function (stateful ops run in program order, so they run one after another, as a training
step's buckets do): TensorFlow's per-call dispatch is paid once per K, as in a training step.
"alone" is the same chain in a process set of this rank alone: TensorFlow's cost of running
the op in a graph plus the runtime's, without a peer (the output still gets its copy of the
input), so graph - alone is what communicating costs, to set against MPI_Allreduce.
"call" is TensorFlow's cost of calling a tf.function that holds one no-op, paid once per graph
call: graph - call/K is what one more allreduce adds to a graph (on a 2-vCPU AMD EPYC VM the
call alone was ~440 us, 14 us per op of a 32-op chain: more than MPI's 4 KiB allreduce).
"eager" is one `keras_ring.allreduce` call from Python, and "TF dispatch" is TensorFlow's own
cost of one eager op on the same tensor (`tf.identity`: dispatch, no work), so eager keras_ring
is within TensorFlow's dispatch cost of MPICH when eager - dispatch <= MPI.

Each round times every column once, in turn; a cell is the median over rounds and the ratio
columns give the range over rounds of keras_ring / MPI_Allreduce measured in the same round
(these machines are noisy: only side-by-side ratios mean anything).

Run with: mpirun -np N python benchmarks/in_graph.py [--max-bytes N] (KERAS_RING_SHM=0: TCP)
"""

from __future__ import annotations

import numpy as np

from mpi4py import MPI  # imported first: keras_ring then leaves MPI to this program

import tensorflow as tf  # noqa: E402

import keras_ring as kr  # noqa: E402

from _bench import preamble, quick, size_range, sizes, timed  # noqa: E402

ROUNDS = 5
CHAIN_BYTES = 64 << 20  # K * nbytes per graph call, at most (K from 1 to MAX_CHAIN)
MAX_CHAIN = 32


def columns(nbytes: int, comm, alone) -> dict:
    """name -> (callable, collectives per call)."""
    host = np.random.default_rng(comm.rank).standard_normal(nbytes // 4).astype(np.float32)
    out = np.empty_like(host)
    tensor = tf.constant(host)
    chain = max(1, min(MAX_CHAIN, CHAIN_BYTES // nbytes))

    def chained(process_set):
        @tf.function(autograph=False)
        def run():
            for _ in range(chain):
                kr.allreduce(tensor, op=kr.Sum, process_set=process_set)
        return run

    @tf.function(autograph=False)
    def call():
        tf.no_op()

    return {
        "graph": (chained(kr.global_process_set), chain),
        "alone": (chained(alone), chain),
        "call": (call, 1),
        "MPI": (lambda: comm.Allreduce(host, out, op=MPI.SUM), 1),
        "eager": (lambda: kr.allreduce(tensor, op=kr.Sum), 1),
        "TF dispatch": (lambda: tf.identity(tensor), 1),
    }


def span(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def main() -> None:
    min_bytes, max_bytes = size_range(256 << 20)
    kr.init()
    comm = MPI.COMM_WORLD
    # Every rank adds every set; each uses its own.
    alone = [kr.add_process_set([r]) for r in range(comm.size)][comm.rank]
    rounds = 2 if quick() else ROUNDS
    preamble(comm, f"float32 Sum; graph = K allreduces in one tf.function (K <= {MAX_CHAIN}); "
                   f"{rounds} interleaved rounds")
    if comm.rank == 0:
        print(f"{'bytes':>10} {'K':>3} | {'graph us':>9} {'alone us':>9} {'call us':>9} "
              f"{'MPI us':>9} {'eager us':>9} {'TF disp us':>10} | {'graph/MPI':>11} "
              f"{'(graph-call/K)/MPI':>18} {'(graph-alone)/MPI':>17} {'(eager-disp)/MPI':>16}")
    for nbytes in sizes(min_bytes, max_bytes):
        cols = columns(nbytes, comm, alone)
        times: dict[str, list[float]] = {name: [] for name in cols}
        for _ in range(rounds):
            for name, (fn, per_call) in cols.items():
                times[name].append(timed(fn, nbytes * per_call, comm) / per_call)
        mpi = times["MPI"]
        graph_ratio = [g / m for g, m in zip(times["graph"], mpi)]
        k = cols["graph"][1]
        op_ratio = [max(g - c / k, 0.0) / m for g, c, m in zip(times["graph"], times["call"], mpi)]
        comm_ratio = [max(g - a, 0.0) / m for g, a, m in zip(times["graph"], times["alone"], mpi)]
        eager_ratio = [max(e - d, 0.0) / m for e, d, m in
                       zip(times["eager"], times["TF dispatch"], mpi)]
        if comm.rank == 0:
            med = {name: float(np.median(v)) * 1e6 for name, v in times.items()}
            print(f"{nbytes:>10} {k:>3} | {med['graph']:9.1f} {med['alone']:9.1f} "
                  f"{med['call']:9.1f} {med['MPI']:9.1f} {med['eager']:9.1f} "
                  f"{med['TF dispatch']:10.1f} | {span(graph_ratio):>11} {span(op_ratio):>18} "
                  f"{span(comm_ratio):>17} {span(eager_ratio):>16}", flush=True)
    kr.shutdown()


if __name__ == "__main__":
    main()
