"""Conditional collectives in the collectives' program order.

Inside ``tf.function`` TensorFlow's automatic control dependencies chain the stateful ops that
take no resource in program order, and that is what keeps every rank's collectives in one
order. An ``If`` whose branch runs a collective is stateful too, but it reads variables (a
check's state, the weights, accumulators), and an op with resource inputs is ordered only
against the other users of those resources. Two such conditionals in one step (two tapes,
two optimizers) then ran in either order, and the ranks' collectives paired wrongly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf


def _order_point() -> tf.Operation:
    # The cheapest stateful op without resource inputs: a clock read. Automatic control
    # dependencies chain it with the collectives, in program order.
    return tf.raw_ops.Timestamp().op


def ordered_cond(pred: Any, true_fn: Callable[[], Any], false_fn: Callable[[], Any]) -> Any:
    """``tf.cond(pred, true_fn, false_fn)`` that runs after the collectives made before it and
    before those made after it, as a collective called in its place would."""
    if tf.executing_eagerly():
        return tf.cond(pred, true_fn, false_fn)
    with tf.control_dependencies([_order_point()]):
        out = tf.cond(pred, true_fn, false_fn)
    with tf.control_dependencies(tf.nest.flatten(out)):
        _order_point()
    return out
