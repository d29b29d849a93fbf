"""Thin calls of the generated ops, and the gradients TensorFlow uses for them.

Everything here assumes validated inputs; keras_ring.collectives does the checking.
"""

from __future__ import annotations

import re

import tensorflow as tf

from keras_ring.ops.loader import library

_NODE_NAME = re.compile(r"[^A-Za-z0-9_.\-/]")

SUM, AVERAGE = 0, 1


def _node_name(kind: str, tensor_name: str) -> str:
    return _NODE_NAME.sub("_", f"KerasRing{kind}_{tensor_name}" if tensor_name else f"KerasRing{kind}")


def _factor_attr(factor: float) -> str:
    # Scale factors travel as exact decimal strings: TensorFlow's float attrs are 32-bit.
    return repr(float(factor))


def _factor(op, attr: str) -> float:
    value = op.get_attr(attr)
    return float(value.decode() if isinstance(value, bytes) else value)


def allreduce(tensor, reduce_op: int, prescale: float, postscale: float, tensor_name: str):
    return library().ops.keras_ring_allreduce(
        tensor, reduce_op=reduce_op, prescale_factor=_factor_attr(prescale),
        postscale_factor=_factor_attr(postscale),
        eager=tf.executing_eagerly(), tensor_name=tensor_name, name=_node_name("Allreduce", tensor_name),
    )


def grouped_allreduce(tensors, reduce_op: int, prescale: float, postscale: float, tensor_name: str):
    return library().ops.keras_ring_grouped_allreduce(
        tensors, reduce_op=reduce_op, prescale_factor=_factor_attr(prescale),
        postscale_factor=_factor_attr(postscale),
        eager=tf.executing_eagerly(), tensor_name=tensor_name, name=_node_name("GroupedAllreduce", tensor_name),
    )


def allgather(tensor, tensor_name: str):
    return library().ops.keras_ring_allgather(
        tensor, eager=tf.executing_eagerly(), tensor_name=tensor_name, name=_node_name("Allgather", tensor_name)
    )


def broadcast(tensor, root_rank: int, tensor_name: str):
    return library().ops.keras_ring_broadcast(
        tensor, root_rank=root_rank, eager=tf.executing_eagerly(), tensor_name=tensor_name, name=_node_name("Broadcast", tensor_name)
    )


def _grad_name(op) -> str:
    name = op.get_attr("tensor_name")
    name = name.decode() if isinstance(name, bytes) else name
    return f"{name}_grad" if name else ""


@tf.RegisterGradient("KerasRingAllreduce")
def _allreduce_grad(op, grad):
    """The allreduce of the upstream gradient, with the same op and scale factors."""
    return allreduce(
        grad, op.get_attr("reduce_op"), _factor(op, "prescale_factor"),
        _factor(op, "postscale_factor"), _grad_name(op),
    )


@tf.RegisterGradient("KerasRingGroupedAllreduce")
def _grouped_allreduce_grad(op, *grads):
    grads = [tf.zeros_like(x) if g is None else g for g, x in zip(grads, op.inputs)]
    return grouped_allreduce(
        grads, op.get_attr("reduce_op"), _factor(op, "prescale_factor"),
        _factor(op, "postscale_factor"), _grad_name(op),
    )


@tf.RegisterGradient("KerasRingAllgather")
def _allgather_grad(op, grad):
    """Average-allreduce of the upstream gradient, sliced to this rank's rows."""
    from keras_ring.basics import rank

    x = op.inputs[0]
    name = _grad_name(op)
    grad = allreduce(grad, AVERAGE, 1.0, 1.0, name)
    rows = tf.reshape(tf.shape(x, out_type=tf.int64)[:1], [-1]) if x.shape.rank != 0 else None
    if rows is None:  # a scalar contributed one row
        rows = tf.constant([1], tf.int64)
    all_rows = allgather(rows, f"{name}.rows" if name else "")
    start = tf.reduce_sum(all_rows[: rank()])
    mine = tf.slice(grad, tf.concat([[start], tf.zeros([tf.rank(grad) - 1], tf.int64)], 0),
                    tf.concat([rows, tf.fill([tf.rank(grad) - 1], tf.constant(-1, tf.int64))], 0))
    return tf.reshape(mine, tf.shape(x))


@tf.RegisterGradient("KerasRingBroadcast")
def _broadcast_grad(op, grad):
    """Sum-allreduce of the upstream gradient on the root, zeros elsewhere."""
    from keras_ring.basics import rank

    summed = allreduce(grad, SUM, 1.0, 1.0, _grad_name(op))
    if rank() == op.get_attr("root_rank"):
        return summed
    return tf.zeros_like(summed)
