"""A process forked from a rank after init() (a multiprocessing pool, a data loader's workers
with the 'fork' start method) holds copies of the parent's runtime: its collectives must fail
at once, saying so, and never touch the parent's connections (one paired with a peer's
collective of the parent's and returned a wrong sum, silently)."""

import atexit
import ctypes
import os

import numpy as np
import tensorflow as tf

import keras_ring
from keras_ring.ops.loader import library


def test_a_forked_child_that_exits_leaves_the_parents_runtime_alone(world):
    rank, size = world
    pid = os.fork()
    if pid == 0:  # the child ends as a program does: Python's exit handlers, then C's exit
        code = 3
        try:
            # The core sees no runtime in a forked child (no TensorFlow op here: TensorFlow's
            # own thread pools may hang in a child forked from a busy process).
            code = 0 if library().c.keras_ring_is_initialized() == 0 else 4
            atexit._run_exitfuncs()
        finally:
            ctypes.CDLL(None).exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # Destroying the copied runtime at the child's exit told the peers this rank shut down.
    for _ in range(3):
        total = keras_ring.allreduce(tf.constant([float(rank + 1)]), op=keras_ring.Sum,
                                     name="fork.after_exit")
        np.testing.assert_array_equal(total.numpy(), [size * (size + 1) / 2])


def test_init_in_a_forked_child_fails_saying_so_while_it_still_knows_its_rank(world):
    # init() returned at once in the child (the parent's runtime looked like its own). A
    # worker's "rank() if is_initialized() else 0" must still pick the rank's shard.
    rank, size = world
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            said = (f"is_initialized={keras_ring.is_initialized()}; "
                    f"shard={keras_ring.rank() if keras_ring.is_initialized() else 0}; ")
            try:
                keras_ring.init()
                said += "init() returned"
            except keras_ring.NotInitializedError as e:
                said += str(e)
            os.write(write, said.encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        said = f.read().decode()
    os.waitpid(pid, 0)
    assert said.startswith(f"is_initialized=True; shard={rank}; keras_ring: init() in this "
                           "process"), said
    assert f"forked from rank {rank}'s process (pid {os.getpid()})" in said, said
    assert keras_ring.is_initialized()
