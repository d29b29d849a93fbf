"""Gradient compression: what dtype gradients travel in between the ranks.

Compression trades precision for bandwidth: a float32 gradient sent as float16 moves half the
bytes. The reduction itself then runs in the wire dtype, so an ``Average`` of float16 values is
computed in float16 (with float32 accumulation inside the reduce kernels where they have it).
"""

from __future__ import annotations

import tensorflow as tf

# Only these are narrowed: integer and already-narrow gradients travel as they are.
_WIDE_FLOATS = (tf.float32, tf.float64)


class Compressor:
    """Casts wide floating-point gradients to ``wire_dtype`` before the wire and back after.

    Use the instances on :class:`Compression` rather than making new ones.

    Args:
        name: a short name shown in ``repr``.
        wire_dtype: the dtype float32/float64 tensors travel in, or None to send every
            tensor as it is.
    """

    def __init__(self, name: str, wire_dtype: tf.DType | None) -> None:
        self.name = name
        self.wire_dtype = wire_dtype

    def wire_dtype_for(self, dtype: tf.DType) -> tf.DType:
        """The dtype a tensor of ``dtype`` travels in."""
        dtype = tf.as_dtype(dtype)
        if self.wire_dtype is not None and dtype in _WIDE_FLOATS:
            return self.wire_dtype
        return dtype

    def compress(self, tensor: tf.Tensor) -> tf.Tensor:
        """Returns ``tensor`` in its wire dtype."""
        wire = self.wire_dtype_for(tensor.dtype)
        return tensor if wire == tensor.dtype else tf.cast(tensor, wire)

    def decompress(self, tensor: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
        """Returns a reduced ``tensor`` in the gradient's own ``dtype`` again."""
        return tensor if tensor.dtype == dtype else tf.cast(tensor, dtype)

    def __repr__(self) -> str:
        return f"keras_ring.Compression.{self.name}"


class Compression:
    """The gradient compressions that ``wrap`` and ``DistributedGradientTape`` accept.

    - ``Compression.none``: gradients travel in their own dtype (the default).
    - ``Compression.fp16``: float32/float64 gradients travel as float16: half the bytes,
      about three significant digits, and values beyond 65504 become inf (under a
      ``LossScaleOptimizer`` such a step is then skipped and the loss scale lowered).
    - ``Compression.bf16``: float32/float64 gradients travel as bfloat16: half the bytes,
      float32's range, about two significant digits.

    Example:

    ```python
    optimizer = keras_ring.wrap(keras.optimizers.SGD(0.1),
                                compression=keras_ring.Compression.fp16)
    ```
    """

    none = Compressor("none", None)
    fp16 = Compressor("fp16", tf.float16)
    bf16 = Compressor("bf16", tf.bfloat16)
