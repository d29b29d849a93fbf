"""One of 4 ranks trying Horovod's ``init(comm=...)`` (test_init_comm.py starts it).

Writes ``$RESULT_DIR/<MPI_COMM_WORLD rank>.json`` with what each case gave here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from mpi4py import MPI  # this program owns MPI, as Horovod's examples with comm= do

import tensorflow as tf

import keras_ring as kr


def _error(call) -> str:
    try:
        call()
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _split_sets(world: int, parity, out: dict) -> None:
    # Horovod's docs on process sets: one set from a split, each rank passing its own part.
    split = kr.ProcessSet(parity)
    kr.init(MPI.COMM_WORLD, process_sets=[split])
    out["sets"] = [split.ranks, split.size(), split.rank(), split.process_set_id,
                   float(kr.allreduce(tf.constant(float(world)), op=kr.Sum, process_set=split)),
                   kr.remove_process_set(split),
                   float(kr.allreduce(tf.constant(float(world)), op=kr.Sum))]
    kr.shutdown()
    # Horovod's docs: a job per sub-communicator.
    kr.init(comm=parity)
    out["split"] = [kr.rank(), kr.size(), kr.local_size(),
                    float(kr.allreduce(tf.constant(float(world)), op=kr.Sum))]
    kr.shutdown()


def _listed_jobs(world: int, parity, out: dict) -> None:
    # A list of MPI_COMM_WORLD ranks, in the order of their new ranks; afresh after shutdown.
    # A set from a communicator names MPI_COMM_WORLD ranks: it becomes the job's own. World
    # ranks 0 and 1 are ranks 1 and 2 of the job [2, 0, 1]; rank 2 names them itself.
    kr.init(comm=[2, 0, 1] if world < 3 else [3])
    low = MPI.COMM_WORLD.Split(color=int(world < 2), key=world)
    if world < 3:
        pair = kr.ProcessSet(low if world < 2 else [1, 2])
        before = pair.included()
        kr.add_process_set(pair)
        reduced = kr.allreduce(tf.constant(float(world)), op=kr.Sum, process_set=pair) \
            if pair.included() else None
        out["list"] = [kr.rank(), kr.size(), before, pair.ranks,
                       None if reduced is None else float(reduced),
                       int(kr.broadcast(tf.constant(world), root_rank=0).numpy())]
    else:
        out["list"] = [kr.rank(), kr.size()]
    kr.shutdown()
    # A set whose communicator reaches outside the job: an error on every rank of the job
    # (world rank 1's part {1, 3} holds 3, outside [0, 1, 2]), which goes on working.
    kr.init(comm=range(3) if world < 3 else [3])
    out["outside"] = [_error(lambda: kr.add_process_set(kr.ProcessSet(parity))),
                      float(kr.allreduce(tf.constant(float(world)), op=kr.Sum))]
    kr.shutdown()


def main() -> None:
    world = MPI.COMM_WORLD.Get_rank()
    parity = MPI.COMM_WORLD.Split(color=world % 2, key=world)
    out: dict = {}
    _split_sets(world, parity, out)
    _listed_jobs(world, parity, out)
    # The launcher's whole job again, without comm as in Horovod: no communicator's table.
    kr.init()
    out["world_again"] = [kr.size(), float(kr.allreduce(tf.constant(float(world)), op=kr.Sum))]
    kr.shutdown()
    out["left_out"] = _error(lambda: kr.init(comm=[r for r in range(4) if r != world]))
    out["out_of_range"] = _error(lambda: kr.init(comm=[world, 7]))
    out["not_a_comm"] = _error(lambda: kr.init(comm=MPI.COMM_WORLD.Get_group()))
    out["null_set"] = _error(lambda: kr.ProcessSet(MPI.COMM_NULL))
    # A file per rank: lines printed by 4 processes at once can interleave in mpirun's output.
    Path(os.environ["RESULT_DIR"], f"{world}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
