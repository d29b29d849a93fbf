"""keras_ring's ops have no XLA kernel: the check that refuses to trace them for XLA.

Every collective op checks as it is made in a graph, so a collective traced into a
``tf.function(jit_compile=True)`` fails then with :class:`JitCompileError`, saying what to
change, not with XLA's "No registered OpKernel for XLA_CPU_JIT" at the first call. Higher
layers (the gradient reduction, ``SyncBatchNormalization``) check before making anything, to
name what they were doing.
"""

from __future__ import annotations

import tensorflow as tf

from keras_ring._errors_base import KerasRingError


class JitCompileError(KerasRingError, ValueError):
    """keras_ring collectives were traced into an XLA-compiled (``jit_compile=True``) function."""

    # Autograph re-raises errors from converted code as their own type only when the type
    # has Exception's constructor; otherwise the user would get a generic StagingError.
    __init__ = Exception.__init__


def in_xla_context() -> bool:
    """True while tracing a function that XLA will compile."""
    try:
        # TensorFlow marks graphs traced under jit_compile=True; there is no public accessor.
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # pragma: no cover - a TensorFlow without the helper
        return False
    return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


def check_not_xla_compiled(what: str) -> None:
    """Raises :class:`JitCompileError` when called while tracing for XLA."""
    if in_xla_context():
        raise JitCompileError(
            f"keras_ring: {what} inside an XLA-compiled function (jit_compile=True), but "
            "keras_ring's collectives have no XLA kernel. Trace this step without XLA: "
            "tf.function(..., jit_compile=False), or model.compile(..., jit_compile=False) "
            "(or model.jit_compile = False before fit, where compile takes other arguments). "
            "(Model.compile already does this by itself for keras_ring.wrap() optimizers.)"
        )
