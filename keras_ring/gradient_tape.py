"""``DistributedGradientTape``: a ``tf.GradientTape`` whose gradients are reduced over ranks."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from keras_ring._buckets import DEFAULT_BUCKET_BYTES, ReduceOptions, reduce_gradients
from keras_ring.collectives import Average, ReduceOp
from keras_ring.compression import Compression, Compressor


class DistributedGradientTape:
    """Wraps a ``tf.GradientTape`` so that ``gradient()`` returns gradients reduced over ranks.

    ``gradient(target, sources)`` computes this rank's gradients with the wrapped tape, then
    allreduces them exactly as :func:`keras_ring.wrap` does (buckets in reverse source order,
    ``None`` gradients skipped, ``tf.IndexedSlices`` allgathered unless ``sparse_as_dense``).
    Use it with a plain optimizer; everything else (``watch``, ``jacobian``, ...) is the
    wrapped tape's. It works eagerly and inside ``tf.function`` (without ``jit_compile``).

    Args:
        tape: the ``tf.GradientTape`` to wrap, usually right after its ``with`` block.
        op, compression, bucket_bytes, sparse_as_dense, gradient_predivide_factor: as for
            :func:`keras_ring.wrap`.

    Example:

    ```python
    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = keras_ring.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    ```
    """

    def __init__(
        self,
        tape: tf.GradientTape,
        *,
        op: ReduceOp = Average,
        compression: Compressor = Compression.none,
        bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
        sparse_as_dense: bool = False,
        gradient_predivide_factor: float = 1.0,
    ) -> None:
        if not isinstance(tape, tf.GradientTape):
            raise TypeError("keras_ring.DistributedGradientTape wraps a tf.GradientTape, got "
                            f"{type(tape).__module__}.{type(tape).__qualname__}")
        self._tape = tape
        self._options = ReduceOptions.create(
            "keras_ring.DistributedGradientTape", op, compression, bucket_bytes,
            sparse_as_dense, gradient_predivide_factor,
        )

    @property
    def tape(self) -> tf.GradientTape:
        """The wrapped ``tf.GradientTape``."""
        return self._tape

    @tf.autograph.experimental.do_not_convert
    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 unconnected_gradients: tf.UnconnectedGradients = tf.UnconnectedGradients.NONE) -> Any:
        """This rank's ``tape.gradient(...)``, reduced over all ranks; same structure as ``sources``."""
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients,
                                    unconnected_gradients=unconnected_gradients)
        flat = tf.nest.flatten(grads, expand_composites=False)
        reduced = reduce_gradients(flat, self._options)
        return tf.nest.pack_sequence_as(grads, reduced, expand_composites=False)

    # The tape is also usable as its own context manager: `with DistributedGradientTape(
    # tf.GradientTape()) as tape:` records into the wrapped tape.
    def __enter__(self) -> "DistributedGradientTape":
        self._tape.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> Any:
        return self._tape.__exit__(*exc_info)

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes not found here: watch, stop_recording, jacobian, ...
        if name.startswith("__") or name in ("_tape", "_options"):
            raise AttributeError(name)
        return getattr(self._tape, name)
