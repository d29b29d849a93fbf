"""A process forked from a rank after init() (a multiprocessing pool, a data loader's workers
with the 'fork' start method) holds copies of the parent's runtime: its collectives must fail
at once, saying so, and never touch the parent's connections (one paired with a peer's
collective of the parent's and returned a wrong sum, silently)."""

import atexit
import ctypes
import multiprocessing
import os

import numpy as np
import tensorflow as tf

import keras_ring


def _collective_in_child(kind: str) -> str:
    try:
        if kind == "eager":
            value = keras_ring.allreduce(tf.constant([1.0]), op=keras_ring.Sum)
        else:
            keras_ring.shutdown()
            keras_ring.init()
            value = keras_ring.allreduce(tf.constant([1.0]), op=keras_ring.Sum)
        return f"returned {value.numpy()}"
    except keras_ring.KerasRingError as e:
        return f"{type(e).__name__}: {e}"


def test_collectives_in_a_forked_child_fail_and_the_parent_goes_on(world):
    rank, size = world
    context = multiprocessing.get_context("fork")
    # Only rank 0 forks: a child that reached a peer would pair with that peer's next
    # collective of the parent's below, as it did before.
    results = []
    if rank == 0:
        with context.Pool(1) as pool:
            # No tf.function: TensorFlow's graph runtime hangs in a forked child by itself.
            results = pool.map(_collective_in_child, ["eager", "init_again"], chunksize=1)
    for result in results:
        assert "was forked from rank 0's process" in result, result
        assert result.startswith(("NotInitializedError", "InitError")), result
        assert "'spawn' or 'forkserver'" in result
    total = keras_ring.allreduce(tf.constant([float(rank + 1)]), op=keras_ring.Sum,
                                 name="fork.after")
    np.testing.assert_array_equal(total.numpy(), [size * (size + 1) / 2])
    assert keras_ring.allgather_object(len(results)) == [2] + [0] * (size - 1)


def test_a_forked_child_that_exits_leaves_the_parents_runtime_alone(world):
    rank, size = world
    pid = os.fork()
    if pid == 0:  # the child ends as a program does: Python's exit handlers, then C's exit
        try:
            atexit._run_exitfuncs()
        finally:
            ctypes.CDLL(None).exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # Destroying the copied runtime at the child's exit told the peers this rank shut down.
    for _ in range(3):
        total = keras_ring.allreduce(tf.constant([float(rank + 1)]), op=keras_ring.Sum,
                                     name="fork.after_exit")
        np.testing.assert_array_equal(total.numpy(), [size * (size + 1) / 2])
