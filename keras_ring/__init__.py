"""keras_ring: synchronous data-parallel training for Keras 3 on TensorFlow.

Example:

```python
import keras, keras_ring, tensorflow as tf
keras_ring.init()
x = keras_ring.allreduce(tf.constant([1.0, 2.0]), op=keras_ring.Sum)
optimizer = keras_ring.wrap(keras.optimizers.Adam(1e-3 * keras_ring.size()))
```
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from keras_ring import _lifecycle
from keras_ring._lazy_exports import lazy_exports

__version__ = "0.1.0"

# Public name -> module that defines it. Imported on first use (PEP 562), so that
# `import keras_ring` (and the keras-ring-run launcher) does not pay for TensorFlow.
_EXPORTS = {
    **dict.fromkeys(
        ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
         "cross_rank", "cross_size"], "keras_ring.basics"),
    **dict.fromkeys(
        ["ReduceOp", "Sum", "Average", "Min", "Max", "Product", "allreduce", "grouped_allreduce",
         "allgather", "broadcast", "broadcast_variables", "barrier", "grouped_allgather",
         "broadcast_", "broadcast_global_variables", "join"],
        "keras_ring.collectives"),
    **dict.fromkeys(["broadcast_object", "broadcast_object_fn", "allgather_object"],
                    "keras_ring.objects"),
    **dict.fromkeys(
        ["reducescatter", "grouped_reducescatter", "alltoall"], "keras_ring.scatter"),
    **dict.fromkeys(["ProcessSet", "global_process_set"], "keras_ring.process_sets"),
    **dict.fromkeys(["add_process_set", "remove_process_set"], "keras_ring.process_set_setup"),
    **dict.fromkeys(
        ["rank_op", "size_op", "local_rank_op", "local_size_op", "process_set_included_op",
         "is_homogeneous", "mpi_built",
         "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled", "nccl_built",
         "cuda_built", "rocm_built", "ddl_built", "ccl_built"], "keras_ring.introspection"),
    **dict.fromkeys(
        ["KerasRingError", "NotInitializedError", "InitError", "CollectiveMismatchError",
         "CollectiveArgumentError", "CollectiveTimeoutError", "PeerFailureError",
         "CollectiveAbortedError", "WeightMismatchError", "LearningRateMismatchError",
         "OptimizerMismatchError", "EpochMismatchError"],
        "keras_ring.errors"),
    # Keras integration: wrap(optimizer), DistributedGradientTape, compression and callbacks.
    "wrap": "keras_ring.optimizer",
    "DistributedOptimizer": "keras_ring.optimizer",
    "PartialDistributedOptimizer": "keras_ring.optimizer",
    "DistributedGradientTape": "keras_ring.gradient_tape",
    "PartialDistributedGradientTape": "keras_ring.gradient_tape",
    "Compression": "keras_ring.compression",
    "SyncBatchNormalization": "keras_ring.sync_batch_normalization",
    "load_model": "keras_ring.saving",
    "callbacks": "keras_ring.callbacks",
    "elastic": "keras_ring.elastic",
    "timeline": "keras_ring.timeline",
}

__all__ = list(_EXPORTS)


# Horovod's names that keras_ring does not offer, and what to use instead.
_HOROVOD_ONLY = {
    "Adasum": "keras_ring has no Adasum reduction (Horovod's); use keras_ring.Average (the "
              "default) or keras_ring.Sum",
    "start_timeline": "set KERAS_RING_TIMELINE=path to record the whole run, or use "
                      "keras_ring.timeline.record(True) inside a program",
    "stop_timeline": "use keras_ring.timeline.record(False) (and keras_ring.timeline.recorded() "
                     "to read this rank's events)",
}

__getattr__, __dir__ = lazy_exports("keras_ring", _EXPORTS, globals(),
                                   submodules=("callbacks", "elastic", "timeline"),
                                   absent=_HOROVOD_ONLY)


# The runtime sits below the modules these steps need, so the package registers them (see
# keras_ring/_lifecycle.py); each imports its module only when it has work to do.

def _install_keras_compile_hook() -> None:
    # `model.compile(optimizer=keras_ring.wrap(...))` looks compile up before wrap runs, so
    # the hook for models compiled with wrapped optimizers must be in place at init().
    if "keras" in sys.modules:
        from keras_ring._model_optimizers import install_compile_hook

        install_compile_hook()
        _register_keras_objects()


def _register_keras_objects() -> None:
    # keras.models.load_model finds our layers by their registered names only, and
    # registering means defining them: done wherever Keras is in use already.
    if "keras" in sys.modules:
        import keras_ring.sync_batch_normalization  # noqa: F401


def _start_timeline() -> None:
    from keras_ring.runtime import RUNTIME

    config = RUNTIME.config
    if config.timeline_path is not None:
        from keras_ring import timeline

        timeline.SPILL.start(RUNTIME.library(), config.timeline_memory_events)


def _write_timeline(config: Config, topology: Topology, lib: Library, failing: bool) -> None:
    if config.timeline_path is not None:
        from keras_ring import timeline

        timeline.write(timeline.trace_path(config.timeline_path), topology, lib,
                       gather=not failing)


def _forget_bucket_tuning(config: Config, topology: Topology, lib: Library,
                          failing: bool) -> None:
    if "keras_ring._bucket_tuning" in sys.modules:  # imported by the Keras integration only
        sys.modules["keras_ring._bucket_tuning"].MEASURED.forget()


def _add_process_sets(process_sets: list) -> None:
    from keras_ring.process_set_setup import add_at_init

    add_at_init(process_sets)


_lifecycle.AFTER_INIT.append(_install_keras_compile_hook)
_lifecycle.AFTER_INIT.append(_start_timeline)
_lifecycle.AFTER_WRAP.append(_install_keras_compile_hook)
_lifecycle.ADD_PROCESS_SETS.append(_add_process_sets)
_lifecycle.BEFORE_SHUTDOWN.append(_write_timeline)
_lifecycle.BEFORE_SHUTDOWN.append(_forget_bucket_tuning)


if TYPE_CHECKING:
    from keras_ring import callbacks
    from keras_ring.basics import (cross_rank, cross_size, init, is_initialized, local_rank,
                                   local_size, rank, shutdown, size)
    from keras_ring.collectives import (Average, Max, Min, Product, ReduceOp, Sum, allgather,
                                        allreduce, barrier, broadcast, broadcast_variables,
                                        grouped_allreduce)
    from keras_ring.objects import allgather_object, broadcast_object, broadcast_object_fn
    from keras_ring.compression import Compression
    from keras_ring.config import Config
    from keras_ring.errors import (CollectiveAbortedError, CollectiveArgumentError,
                                   CollectiveMismatchError, CollectiveTimeoutError,
                                   EpochMismatchError, InitError, KerasRingError,
                                   LearningRateMismatchError, OptimizerMismatchError,
                                   NotInitializedError, PeerFailureError, WeightMismatchError)
    from keras_ring.gradient_tape import DistributedGradientTape, PartialDistributedGradientTape
    from keras_ring.ops.loader import Library
    from keras_ring.optimizer import DistributedOptimizer, PartialDistributedOptimizer, wrap
    from keras_ring.saving import load_model
    from keras_ring.sync_batch_normalization import SyncBatchNormalization
    from keras_ring.peer_table import Topology


_register_keras_objects()  # a program that imported keras first: load_model works from here
