"""Horovod's questions about the job and the build, answered for keras_ring.

``rank_op`` and friends are graph ops: inside ``tf.function`` they read the value when the
graph runs, not when it was traced. The ``*_built``/``*_enabled`` functions answer what a
Horovod program asks before choosing a code path; keras_ring has its own ring (no Gloo),
uses MPI only to find its peers, and loads NCCL at run time.

Example:

```python
@tf.function
def step():
    tf.print("rank", keras_ring.rank_op(), "of", keras_ring.size_op())
```
"""

from __future__ import annotations

import importlib.util
import sys

import tensorflow as tf

from keras_ring import basics
from keras_ring.runtime import RUNTIME


def _graph_value(read, what: str) -> tf.Tensor:
    RUNTIME.topology(f"keras_ring.{what}()")  # not initialized: say so now, not in the graph
    value = tf.py_function(lambda: tf.constant(read(), tf.int32), [], tf.int32, name=what)
    value.set_shape([])
    return value


@tf.autograph.experimental.do_not_convert
def rank_op(name: str | None = None) -> tf.Tensor:
    """This process's rank, as an int32 op evaluated when the graph runs."""
    del name
    return _graph_value(basics.rank, "rank_op")


@tf.autograph.experimental.do_not_convert
def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """The number of processes (of process set ``process_set_id``; all by default), as an
    int32 op evaluated when the graph runs. Horovod's signature: an id passed first is a set's,
    never a name."""
    del name
    if process_set_id == 0:
        return _graph_value(basics.size, "size_op")

    def set_size() -> int:
        sets = RUNTIME.process_set_ids()
        if process_set_id not in sets:
            raise ValueError(f"keras_ring.size_op: no process set has id {process_set_id!r} "
                             f"(registered: {sorted(sets)})")
        return len(sets[process_set_id])

    return _graph_value(set_size, "size_op")


@tf.autograph.experimental.do_not_convert
def local_rank_op(name: str | None = None) -> tf.Tensor:
    """This process's index on its host, as an int32 op evaluated when the graph runs."""
    del name
    return _graph_value(basics.local_rank, "local_rank_op")


@tf.autograph.experimental.do_not_convert
def local_size_op(name: str | None = None) -> tf.Tensor:
    """The number of processes on this host, as an int32 op evaluated when the graph runs."""
    del name
    return _graph_value(basics.local_size, "local_size_op")


# Horovod's codes for process_set_included_op.
PROCESS_SET_ERROR_INIT = -1
PROCESS_SET_ERROR_UNKNOWN_SET = -3


@tf.autograph.experimental.do_not_convert
def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """1 if this process belongs to process set ``process_set_id``, 0 if not, read when the
    graph runs; Horovod's error codes -1 (not initialized) and -3 (unknown set)."""
    del name

    def included() -> tf.Tensor:
        if not RUNTIME.initialized:
            return tf.constant(PROCESS_SET_ERROR_INIT, tf.int32)
        sets = RUNTIME.process_set_ids()
        if process_set_id not in sets:
            return tf.constant(PROCESS_SET_ERROR_UNKNOWN_SET, tf.int32)
        return tf.constant(int(RUNTIME.topology().rank in sets[process_set_id]), tf.int32)

    value = tf.py_function(included, [], tf.int32, name="process_set_included_op")
    value.set_shape([])
    return value


def is_homogeneous() -> bool:
    """True when every host runs the same number of processes."""
    topo = RUNTIME.topology("keras_ring.is_homogeneous()")
    counts = {topo.host_ids.count(h) for h in set(topo.host_ids)}
    return len(counts) == 1


def mpi_built() -> bool:
    """Whether mpi4py is installed (``pip install keras-ring[mpi]``): keras_ring links no MPI
    and uses mpi4py only to find its peers under ``mpirun``."""
    return importlib.util.find_spec("mpi4py") is not None


def mpi_enabled() -> bool:
    """Whether this job found its peers through MPI (started by ``mpirun``; keras_ring then
    finalises MPI unless the program imported mpi4py itself)."""
    RUNTIME.topology("keras_ring.mpi_enabled()")
    return RUNTIME.via_mpi


def mpi_threads_supported() -> bool:
    """Whether MPI runs with ``MPI_THREAD_MULTIPLE`` in this job (False without MPI)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if not mpi_enabled() or mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return False
    return mpi.Query_thread() == mpi.THREAD_MULTIPLE


def gloo_built() -> bool:
    """False: keras_ring moves data with its own ring (shared memory and TCP), not Gloo."""
    return False


def gloo_enabled() -> bool:
    """False: keras_ring moves data with its own ring (shared memory and TCP), not Gloo."""
    return False


def nccl_built() -> int:
    """The NCCL version GPU collectives would use as Horovod reports it (e.g. 22304 for
    2.23.4), or 0 when no usable NCCL is found. NCCL is loaded at run time, so this is the
    answer for this machine, not for how keras_ring was built."""
    from keras_ring import gpu

    try:
        major, minor, patch = (int(p) for p in gpu.nccl_version().split("."))
    except RuntimeError:
        return 0
    return major * 10000 + minor * 100 + patch


def cuda_built() -> bool:
    """Whether this TensorFlow has CUDA, i.e. keras_ring's GPU kernels are registered."""
    return bool(tf.test.is_built_with_cuda())


def rocm_built() -> bool:
    """False: keras_ring has no ROCm backend."""
    return False


def ddl_built() -> bool:
    """False: keras_ring has no IBM DDL backend."""
    return False


def ccl_built() -> bool:
    """False: keras_ring has no oneCCL backend."""
    return False
