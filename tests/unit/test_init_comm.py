"""Horovod's ``init(comm=...)`` under a real mpirun of 4 processes (tests/unit/comm_child.py):
each sub-communicator, or list of MPI_COMM_WORLD ranks, is an independent job."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import keras_ring

CHILD = Path(__file__).with_name("comm_child.py")


def test_each_communicator_is_a_job_of_its_own(mpirun, clean_env, tmp_path):
    env = dict(clean_env, KERAS_RING_TIMEOUT_SECONDS="30", RESULT_DIR=str(tmp_path))
    proc = subprocess.run([mpirun, "-np", "4", sys.executable, str(CHILD)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = {int(f.stem): json.loads(f.read_text()) for f in tmp_path.glob("*.json")}
    assert sorted(results) == [0, 1, 2, 3], proc.stdout + proc.stderr
    for world, out in results.items():
        odd = world % 2
        # A set made from a split is one set per part, each with its own id and runtime;
        # removed together; the whole job's collectives go on.
        assert out["sets"] == [[1, 3] if odd else [0, 2], 2, world // 2, 2 if odd else 1,
                               4.0 if odd else 2.0, True, 6.0]
        # Split by parity, ordered by world rank: {0, 2} sum 2, {1, 3} sum 4.
        assert out["split"] == [world // 2, 2, 2, 4.0 if odd else 2.0]
        # The list [2, 0, 1]: world 2 is rank 0; the set {world 0, world 1} is ranks [1, 2]
        # (sum 0 + 1; included() translated before it was added), and rank 0 (world 2) is
        # outside it. World 3 is a job of one.
        assert out["list"] == {0: [1, 3, True, [1, 2], 1.0, 2], 1: [2, 3, True, [1, 2], 1.0, 2],
                               2: [0, 3, False, [1, 2], None, 2], 3: [0, 1]}[world]
        # Rank 1's part reaches outside its job: every rank of that job says so.
        problem = ("ValueError: keras_ring.add_process_set: on rank {}, its set's communicator "
                   "holds MPI_COMM_WORLD ranks [{}], which are not in the communicator "
                   "keras_ring.init(comm=...) was given (MPI_COMM_WORLD ranks {})")
        assert out["outside"] == ([problem.format(0, 1, [3]), 3.0] if world == 3 else
                                  [problem.format(1, 3, [0, 1, 2]), 3.0])
        assert out["world_again"] == [4, 6.0]
        assert out["left_out"] == (
            f"ValueError: keras_ring.init: comm={[r for r in range(4) if r != world]} leaves out "
            f"this process (MPI_COMM_WORLD rank {world}); only the listed ranks call init with it")
        assert out["out_of_range"].startswith(
            f"ValueError: keras_ring.init: comm=[{world}, 7] names ranks [7], but MPI_COMM_WORLD "
            "has ranks 0..3")
        assert out["not_a_comm"].startswith(
            "TypeError: keras_ring.init: comm must be an mpi4py intra-communicator or a list")
        assert out["null_set"].startswith("ValueError: ProcessSet got MPI.COMM_NULL")


@pytest.mark.parametrize("first", [[keras_ring.ProcessSet([0])], "dynamic"])
def test_process_sets_in_comms_place_say_to_pass_them_by_keyword(first):
    with pytest.raises(TypeError, match=r"the first argument is Horovod's comm .*pass process "
                                        r"sets by keyword: init\(process_sets="):
        keras_ring.init(first)


def test_comm_world_is_the_job_under_the_environment_rendezvous_too(clean_env):
    # keras-ring-run without MPI: each process's MPI_COMM_WORLD is itself alone, but
    # init(comm=MPI.COMM_WORLD) means the launcher's whole job, not a job of one per process.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        rendezvous = f"127.0.0.1:{s.getsockname()[1]}"
    code = ("from mpi4py import MPI; import tensorflow as tf, keras_ring as kr; "
            "kr.init(comm=MPI.COMM_WORLD); "
            "print('RESULT', kr.rank(), kr.size(), float(kr.allreduce(tf.constant(1.0), op=kr.Sum)));"
            "kr.shutdown()\n"
            "try:\n    kr.init(comm=[0])\nexcept kr.InitError as e:\n    print('REFUSED', e)")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=dict(
                                  clean_env, KERAS_RING_RANK=str(r), KERAS_RING_SIZE="2",
                                  KERAS_RING_RENDEZVOUS=rendezvous, KERAS_RING_TIMEOUT_SECONDS="30"))
             for r in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outputs)
    results = sorted(line for out in outputs for line in out.splitlines() if line.startswith("RESULT"))
    assert results == ["RESULT 0 2 2.0", "RESULT 1 2 2.0"], "\n".join(outputs)
    # A part of it would be a job of one per process there: refused on every rank.
    refused = [line for out in outputs for line in out.splitlines() if line.startswith("REFUSED")]
    assert len(refused) == 2 and all("keras-ring-run started this process without MPI" in r
                                     for r in refused), "\n".join(outputs)


_SPAWNS_A_TRAINER = """
import multiprocessing, os, sys

def train(path):
    import keras_ring
    try:
        keras_ring.init()
        result = f"initialised: rank {keras_ring.rank()}"
    except Exception as e:  # noqa: BLE001 - the test reads what was raised
        result = f"{type(e).__name__}: {e}"
    with open(path, "w") as f:
        f.write(result)

if __name__ == "__main__":
    path = os.path.join(sys.argv[1], os.environ["PMI_RANK"])
    child = multiprocessing.get_context("spawn").Process(target=train, args=(path,))
    child.start()
    child.join()
    sys.exit(child.exitcode)
"""


def test_init_in_a_spawned_child_of_a_rank_says_it_has_no_connection_to_mpirun(
        mpirun, clean_env, tmp_path):
    # The child inherits PMI_FD but not the descriptor: MPI_Init failed writing to it and
    # killed the child (exit 15, MPICH's PMIU_write noise) with no Python error at all.
    script = tmp_path / "spawns.py"
    script.write_text(_SPAWNS_A_TRAINER)
    env = dict(clean_env, KERAS_RING_TIMEOUT_SECONDS="30")
    proc = subprocess.run([mpirun, "-np", "2", sys.executable, str(script), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300)
    for rank in "01":
        result = tmp_path / rank
        assert result.exists(), proc.stdout + proc.stderr
        text = result.read_text()
        assert text.startswith("InitError: "), text
        assert "not that rank's connection to mpirun" in text and "'spawn'" in text, text
