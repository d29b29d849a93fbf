"""A sane default for TensorFlow's CPU threads when several ranks share a host.

By default every TensorFlow process sizes its intra-op pool to all cores of the machine, so
N ranks on one host run N times as many busy threads as there are cores, and they slow each
other down. ``init()`` gives each rank ``cores // local_size`` intra-op threads instead — unless
the user chose: ``tf.config.threading.set_intra_op_parallelism_threads`` before ``init()``,
``TF_NUM_INTRAOP_THREADS``, or ``KERAS_RING_INTRA_OP_THREADS`` (a number, or 0 to leave
TensorFlow's default alone).
"""

from __future__ import annotations

import os
import warnings


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_intra_op_threads(local_size: int, cores: int | None = None) -> int:
    return max(1, (cores or available_cores()) // max(local_size, 1))


def configure(local_size: int, requested: int | None) -> int | None:
    """Sets the intra-op pool size unless the user already decided; returns what was set."""
    import tensorflow as tf

    if requested == 0 or "TF_NUM_INTRAOP_THREADS" in os.environ:
        return None
    if tf.config.threading.get_intra_op_parallelism_threads() != 0:
        return None  # set explicitly by the program
    threads = requested or default_intra_op_threads(local_size)
    if requested is None and local_size <= 1:
        return None
    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
    except RuntimeError:  # TensorFlow already started its pools; nothing can change them now
        if requested is not None:  # the user asked for it: say that it did not happen
            warnings.warn(
                f"keras_ring: KERAS_RING_INTRA_OP_THREADS={requested} was ignored: a TensorFlow "
                "op ran before keras_ring.init(), so TensorFlow's thread pools already exist. "
                "Call keras_ring.init() before any TensorFlow op.", stacklevel=3)
        return None
    return threads
