"""Helpers for the Keras integration tests: seeded data, tiny models, sharding, comparisons.

Every rank can compute every rank's data and initial model from seeds, so a test computes
its single-process reference locally, without communication.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

import keras

FEATURES, CLASSES = 6, 3


def classification_data(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A learnable 3-class problem: labels are the argmax of a fixed linear map."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    w = rng.normal(size=(FEATURES, CLASSES)).astype("float32")
    return x, np.argmax(x @ w, axis=1).astype("int64")


def mlp(seed: int, hidden: int = 8) -> keras.Model:
    """A small MLP whose initial weights depend only on ``seed``."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(hidden, activation="tanh"),
        keras.layers.Dense(CLASSES),
    ])


def rank_seed(rank: int) -> int:
    return 1000 + rank


def shard(array: np.ndarray, rank: int, size: int, batch: int) -> np.ndarray:
    """Rank ``rank``'s rows such that global batch k of size ``size*batch`` is split in rank order.

    Global batch k is rows [k*size*batch, (k+1)*size*batch); rank r gets its r-th slice of
    ``batch`` rows. So ``size`` ranks with batch ``batch`` see what one process with batch
    ``size*batch`` sees, in the same order.
    """
    steps = len(array) // (size * batch)
    parts = [array[(k * size + rank) * batch:(k * size + rank + 1) * batch] for k in range(steps)]
    return np.concatenate(parts)


def loss() -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def weights(model: keras.Model) -> list[np.ndarray]:
    return [np.array(w) for w in model.get_weights()]


def assert_weights_close(actual: list, expected: list, atol: float, rtol: float = 0.0) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, atol=atol, rtol=rtol)


def assert_same_on_all_ranks(arrays: list) -> None:
    """Every rank holds bitwise the same arrays (checked by gathering them)."""
    import keras_ring

    for i, a in enumerate(arrays):
        a = np.asarray(a)
        gathered = keras_ring.allgather(tf.constant(a.reshape(1, -1)), name=f"same_on_all.{i}")
        for row in gathered.numpy():
            np.testing.assert_array_equal(row, a.reshape(-1))
