"""Variables that Keras overwrites with their "gradient": float8 training's scales and amax
histories (``keras.Variable.overwrite_with_gradient``).

Their gradient is the variable's next value, computed from this rank's batch: the largest
magnitude seen, pushed onto a history, and the scale derived from it. Averaging or summing
such values is wrong (a sum doubles the history at every step on 2 ranks); the ranks'
maximum is what one process would record for the global batch, since the history is the same
on every rank and the scale grows with the amax. Keras itself accumulates them over
micro-batches with ``maximum``, never a sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from keras_ring._buckets import ReduceOptions
from keras_ring.collectives import Max, grouped_allreduce


def overwrites(source: Any) -> bool:
    """True for a variable whose gradient replaces its value (a ``tf.Variable`` has no such)."""
    return getattr(source, "overwrite_with_gradient", False) is True


def reduce_new_values(values: Sequence[Any], options: ReduceOptions, name: str) -> list[Any]:
    """The ranks' elementwise maximum of each value (None stays None), uncompressed and
    unscaled: these are not gradients."""
    live = [i for i, v in enumerate(values) if v is not None]
    out: list[Any] = [None] * len(values)
    if not live:
        return out
    reduced = grouped_allreduce([tf.convert_to_tensor(values[i]) for i in live], op=Max,
                                name=f"{name}.new_values", process_set=options.process_set)
    for i, r in zip(live, reduced):
        out[i] = r
    return out


def combine_passes(new_value: bool, grad: Any, total: Any) -> Any:
    """One pass's gradient added to the passes' total; a new value taken by its maximum."""
    return tf.maximum(grad, total) if new_value else grad + total
