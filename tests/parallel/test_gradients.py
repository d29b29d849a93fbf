"""Gradients of the collectives: numerical checks and the documented definitions."""

import numpy as np
import tensorflow as tf

import keras_ring as kr


def test_allreduce_numerical_gradient(world):
    rank, size = world
    x = tf.constant(np.arange(4, dtype=np.float64) + rank)
    for op in (kr.Sum, kr.Average):
        theoretical, numerical = tf.test.compute_gradient(lambda t: kr.allreduce(t, op=op) * 3.0, [x])
        np.testing.assert_allclose(theoretical[0], numerical[0], rtol=1e-6, atol=1e-6)


def test_allreduce_gradient_is_allreduce_of_upstream(world):
    rank, size = world
    x = tf.constant([1.0, 2.0, 3.0])
    w = tf.constant([1.0, 10.0, 100.0]) * (rank + 1)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.reduce_sum(kr.allreduce(x, op=kr.Sum, prescale_factor=2.0) * w)
    grad = tape.gradient(y, x).numpy()
    expected = 2.0 * np.array([1.0, 10.0, 100.0]) * sum(r + 1 for r in range(size))
    np.testing.assert_allclose(grad, expected)


def test_grouped_allreduce_gradient(world):
    rank, size = world
    a, b = tf.constant([1.0, 2.0]), tf.constant(3.0, tf.float64)
    with tf.GradientTape() as tape:
        tape.watch([a, b])
        ra, rb = kr.grouped_allreduce([a, b], op=kr.Average)
        y = tf.reduce_sum(ra) * (rank + 1)
    ga, gb = tape.gradient(y, [a, b], unconnected_gradients=tf.UnconnectedGradients.ZERO)
    mean_weight = sum(r + 1 for r in range(size)) / size
    np.testing.assert_allclose(ga.numpy(), [mean_weight] * 2)
    assert gb.numpy() == 0.0


def test_allgather_gradient_is_average_sliced_to_own_rows(world):
    rank, size = world
    rows = [r + 1 for r in range(size)]
    x = tf.constant(np.full((rows[rank], 2), 1.0))
    total = sum(rows)
    # Upstream differs per rank: rank r weights output row i by (r + 1) * (i + 1).
    weights = [np.outer(np.arange(1, total + 1), [1.0, 1.0]) * (r + 1) for r in range(size)]
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.reduce_sum(kr.allgather(x) * weights[rank])
    grad = tape.gradient(y, x).numpy()
    start = sum(rows[:rank])
    expected = np.mean(weights, axis=0)[start:start + rows[rank]]
    np.testing.assert_allclose(grad, expected)


def test_broadcast_gradient_sums_on_root_zero_elsewhere(world):
    rank, size = world
    root = size - 1
    x = tf.constant([1.0, 2.0])
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.reduce_sum(kr.broadcast(x, root_rank=root) * float(rank + 1))
    grad = tape.gradient(y, x).numpy()
    expected = np.full(2, sum(r + 1 for r in range(size))) if rank == root else np.zeros(2)
    np.testing.assert_allclose(grad, expected)


def test_gradient_inside_tf_function(world):
    rank, size = world

    @tf.function
    def grad_of(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(kr.allreduce(x, op=kr.Average) ** 2)
        return tape.gradient(y, x)

    x = tf.constant([1.0, 2.0]) * (rank + 1)
    mean = np.array([1.0, 2.0]) * sum(r + 1 for r in range(size)) / size
    np.testing.assert_allclose(grad_of(x).numpy(), 2 * mean, rtol=1e-6)
