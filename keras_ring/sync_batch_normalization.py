"""``SyncBatchNormalization``: batch normalization over the global batch of all ranks."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from keras_ring import _xla
from keras_ring.basics import size
from keras_ring.collectives import Sum, allreduce


@keras.saving.register_keras_serializable(package="keras_ring")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization`` whose training statistics cover every rank's batch.

    In training, the batch mean and variance are those of the global batch (the
    concatenation of all ranks' batches), so a model trained on N ranks with batch B
    normalizes like one process with batch N*B, and the moving statistics are the same on
    every rank. The ranks' sums and element counts are allreduced, so ranks may hold
    batches of different sizes (the last batch of an epoch, uneven shards, masks). The
    variance is computed in two passes (mean first, then squared deviations from it), as
    ``BatchNormalization`` does, so large means do not cost precision; that is two small
    allreduces per layer and step, and gradients flow through both to every rank. Outside
    training (and in a world of one) it is ``BatchNormalization``.

    Every rank must call the layer in training the same number of times, in the same
    order (the statistics are collectives). It saves with its own class name; loading needs
    ``keras_ring`` imported (``keras_ring.load_model`` does that).

    Args:
        fused: accepted for Horovod's signature; only False (the default) is allowed.
        **kwargs: ``keras.layers.BatchNormalization``'s arguments (``axis``, ``momentum``,
            ``epsilon``, ``center``, ``scale``, initializers, ``renorm``, ...);
            ``synchronized=True`` (``tf.distribute``'s synchronization) is not supported.

    Example:

    ```python
    model = keras.Sequential([
        keras.Input((32, 32, 3)),
        keras.layers.Conv2D(16, 3),
        keras_ring.SyncBatchNormalization(momentum=0.9),
        keras.layers.ReLU(),
    ])
    ```
    """

    def __init__(self, fused: bool = False, **kwargs: Any) -> None:
        if fused is not False:
            raise ValueError(f"SyncBatchNormalization does not support fused=True (there is no "
                             f"fused kernel for synchronized statistics), got fused={fused!r}")
        if kwargs.get("synchronized"):
            raise ValueError("SyncBatchNormalization synchronizes through keras_ring, not "
                             "tf.distribute: leave out synchronized, got "
                             f"synchronized={kwargs['synchronized']!r}")
        super().__init__(**kwargs)
        self._keras_ring_synced = False

    def call(self, inputs: tf.Tensor, training: bool | None = None,
             mask: tf.Tensor | None = None) -> tf.Tensor:
        # The statistics are synchronized by overriding Keras's private _moments; should a
        # Keras stop calling it, training would normalize with local statistics, silently.
        self._keras_ring_synced = False
        outputs = super().call(inputs, training=training, mask=mask)
        if training and self.trainable and size() > 1 and not self._keras_ring_synced:
            raise RuntimeError(
                f"SyncBatchNormalization does not work with this Keras ({keras.__version__}): "
                "its BatchNormalization no longer computes batch statistics in _moments, so "
                "they would stay local to each rank. Use a Keras version keras_ring supports "
                "(see the README's 'Supported versions').")
        return outputs

    def _moments(self, inputs: tf.Tensor, mask: tf.Tensor | None) -> tuple[tf.Tensor, tf.Tensor]:
        if size() == 1:
            return super()._moments(inputs, mask)
        _xla.check_not_xla_compiled("SyncBatchNormalization's statistics")
        self._keras_ring_synced = True
        channel = self.axis % len(inputs.shape)
        axes = [i for i in range(len(inputs.shape)) if i != channel]
        if mask is None:
            keep = tf.ones_like(inputs, dtype=tf.bool)
            # BatchNormalization adds epsilon to the count only when there is a mask.
            epsilon = 0.0
        else:
            keep = tf.broadcast_to(tf.cast(mask, tf.bool)[..., tf.newaxis], tf.shape(inputs))
            epsilon = keras.backend.epsilon()
        zeros = tf.zeros_like(inputs)

        def sum_over_batch(x: tf.Tensor) -> tf.Tensor:  # keeps dims: broadcasts on any axis
            return tf.reduce_sum(x, axis=axes, keepdims=True)

        # One allreduce of [sum, count] per channel gives the global mean; a second one
        # of the squared deviations from it gives the variance. The names are fixed, not
        # the layer's: ranks may number their layers differently.
        local = tf.stack([sum_over_batch(tf.where(keep, inputs, zeros)),
                          sum_over_batch(tf.cast(keep, inputs.dtype))])
        total = allreduce(local, op=Sum, name="SyncBatchNormalization.mean")
        count = total[1] + epsilon
        mean = total[0] / count
        # As tf.nn.moments: no gradient through the mean here (its derivative is zero).
        deviation = tf.where(keep, inputs - tf.stop_gradient(mean), zeros)
        squares = allreduce(sum_over_batch(tf.square(deviation)), op=Sum,
                            name="SyncBatchNormalization.variance")
        return tf.reshape(mean, [-1]), tf.reshape(squares / count, [-1])
