"""Gradient compression: what gradients look like on the wire between the ranks.

Compression trades precision for bandwidth: a float32 gradient sent as float16 moves half the
bytes. The reduction itself then runs in the wire dtype, so an ``Average`` of float16 values is
computed in float16 (with float32 accumulation inside the reduce kernels where they have it),
and like a Sum: the ranks' sum, divided at the end, must stay within float16's 65504.

A compressor has Horovod's shape: ``compress(tensor) -> (wire_tensor, ctx)`` and
``decompress(reduced_wire_tensor, ctx) -> tensor``. ``wrap`` and ``DistributedGradientTape``
take keras_ring's :class:`Compression` members or any object (or class with static methods)
of that shape, so a compressor written for Horovod works unchanged.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from keras_ring.collectives import check_compression  # noqa: F401  (the compressors' check)

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

    def compress(self, tensor: tf.Tensor) -> tuple[tf.Tensor, tf.DType]:
        """Returns ``tensor`` in its wire dtype, and its own dtype as the context."""
        wire = self.wire_dtype_for(tensor.dtype)
        return (tensor if wire == tensor.dtype else tf.cast(tensor, wire)), tensor.dtype

    def decompress(self, tensor: tf.Tensor, ctx: tf.DType) -> tf.Tensor:
        """Returns a reduced ``tensor`` in the gradient's own dtype ``ctx`` again."""
        return tensor if tensor.dtype == ctx else tf.cast(tensor, ctx)

    def __repr__(self) -> str:
        return f"keras_ring.Compression.{self.name}"


class Compression:
    """The gradient compressions that ``wrap`` and ``DistributedGradientTape`` accept.

    - ``Compression.none``: gradients travel in their own dtype (the default).
    - ``Compression.fp16``: float32/float64 gradients travel as float16: half the bytes,
      about three significant digits, and values whose sum over the ranks passes 65504
      become inf, an ``Average`` too: it divides after summing, as Horovod does, so at 4 ranks
      gradients of about 16384 each overflow (under a ``LossScaleOptimizer`` such a step is
      then skipped and the loss scale lowered).
    - ``Compression.bf16``: float32/float64 gradients travel as bfloat16: half the bytes,
      float32's range, about two significant digits.

    Any object with ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx) ->
    tensor`` is accepted too (Horovod's ``Compressor`` interface).

    Example:

    ```python
    optimizer = keras_ring.wrap(keras.optimizers.SGD(0.1),
                                compression=keras_ring.Compression.fp16)

    class Scaled:  # a compressor in Horovod's shape
        @staticmethod
        def compress(tensor):
            return tensor * 1024.0, None

        @staticmethod
        def decompress(tensor, ctx):
            return tensor / 1024.0

    optimizer = keras_ring.wrap(keras.optimizers.SGD(0.1), compression=Scaled)
    ```
    """

    none = Compressor("none", None)
    fp16 = Compressor("fp16", tf.float16)
    bf16 = Compressor("bf16", tf.bfloat16)


def casts_only(compression: Any) -> bool:
    """True for keras_ring's own members, whose context is just the dtype.

    Those may also compress the values of sparse gradients, which are allgathered: a user's
    compressor's context describes this rank's tensor, not the rows gathered from every rank.
    """
    return type(compression) is Compressor
