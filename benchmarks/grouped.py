"""Grouped allreduce in a graph against one tensor of the same bytes, side by side (issue 17).

Run with: mpirun -np 2 python benchmarks/grouped.py [--rounds 40] [--bytes 4194304]
Each round times, back to back in one run, one batch of CALLS calls of each function (in an
order that rotates every round, so no function always follows the same one): one tensor of
BYTES allreduced in a tf.function, then BYTES split into k tensors (k = 4, 16, 64, 256) grouped
in one tf.function, the results consumed inside the graph (as a training step's gradients
are: nothing returns to Python), and "TF x<k>": the same graph making and consuming the k
tensors without a collective (TensorFlow's own cost of them). A row gives a round's times (per
call, the slowest rank's) and each grouped time over the single time of the same round; the
last lines give the ratios' median and quartiles over rounds, the same ratios less
TensorFlow's own cost, and the cost per added tensor (k=4 to k=256). Short batches taken in
turn put the machine's noise on every function alike, which longer runs of one do not.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from mpi4py import MPI  # imported first: keras_ring then leaves MPI to this program

import tensorflow as tf  # noqa: E402

import keras_ring as kr  # noqa: E402

from _bench import preamble  # noqa: E402

COUNTS = (4, 16, 64, 256)


def functions(nbytes: int, rank: int) -> dict:
    """name -> tf.function; "x<k>" allreduces k tensors made inside the graph (as gradients
    are), "TF x<k>" makes and consumes the same k tensors without a collective."""
    host = np.random.default_rng(rank).standard_normal(nbytes // 4).astype(np.float32)
    whole = tf.constant(host)
    fns = {}
    for k in (1,) + COUNTS:
        per = host.size // k

        def make(k=k, per=per):  # k fresh tensors, as backprop hands them over
            return [whole[i * per:(i + 1) * per] * 1.0 for i in range(k)]

        def consume(outs):
            return tf.add_n([o[0] for o in outs])

        def grouped(k=k, make=make):
            return consume(kr.grouped_allreduce(make(), op=kr.Sum) if k > 1
                           else [kr.allreduce(make()[0], op=kr.Sum)])

        def alone(make=make):
            return consume(make())

        fns["single" if k == 1 else f"x{k}"] = tf.function(grouped, autograph=False)
        fns[f"TF x{k}"] = tf.function(alone, autograph=False)
    return fns


def batch(fn, calls: int, comm) -> float:
    """Seconds per call of `calls` calls started together on every rank, the slowest rank's."""
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return comm.allreduce((time.perf_counter() - start) / calls, op=MPI.MAX)


def spread(values: list[float]) -> str:
    """Median, then the quartiles and the extremes of the rounds."""
    q1, med, q3 = np.quantile(values, [0.25, 0.5, 0.75])
    return (f"{med:.2f} (quartiles {q1:.2f} .. {q3:.2f}; "
            f"all {min(values):.2f} .. {max(values):.2f})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--bytes", type=int, default=4 << 20)
    args = parser.parse_args()
    kr.init()
    comm = MPI.COMM_WORLD
    preamble(comm, f"float32 Sum; {args.bytes} B per rank as 1 tensor or k grouped, "
                   "in tf.function")
    fns = functions(args.bytes, comm.rank)
    if comm.rank == 0:
        print("round" + "".join(f" | {name + '(us)':>11}" for name in fns)
              + "".join(f" | {f'x{k}/1':>6}" for k in COUNTS))
    for fn in fns.values():  # traced and warm
        fn()
        fn()
    names = list(fns)
    rows = []
    for r in range(args.rounds):
        t = {}
        for name in names[r % len(names):] + names[:r % len(names)]:
            t[name] = batch(fns[name], args.calls, comm)
        t = {name: t[name] for name in names}
        rows.append(t)
        if comm.rank == 0:
            print(f"{r:>5}" + "".join(f" | {v * 1e6:11.1f}" for v in t.values())
                  + "".join(f" | {t[f'x{k}'] / t['single']:6.2f}" for k in COUNTS), flush=True)
    if comm.rank == 0:
        for k in COUNTS:
            ratios = [t[f"x{k}"] / t["single"] for t in rows]
            # The collective's own share: each time less TensorFlow's for the same tensors.
            own = [(t[f"x{k}"] - t[f"TF x{k}"]) / (t["single"] - t["TF x1"]) for t in rows]
            print(f"# x{k}/single: median {spread(ratios)}; less TF's own cost of the "
                  f"tensors: median {spread(own)}")
        lo, hi = COUNTS[0], COUNTS[-1]
        slopes = [(t[f"x{hi}"] - t[f"x{lo}"]) / (hi - lo) * 1e6 for t in rows]
        print(f"# cost per added tensor, us: median {spread(slopes)}")
    kr.shutdown()


if __name__ == "__main__":
    main()
