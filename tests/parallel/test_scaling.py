"""Every dtype x op x scale factor, dense and sparse, against NumPy.

Integers are where scaling goes wrong silently: a factor cast to the integer dtype is 0 or
1, and truncating each contribution before summing differs from truncating the sum. The
reference (tests/reference.py) is what keras_ring documents for dense tensors: integers scale
with truncation toward zero and saturation, Average divides the sum exactly. A sparse
allreduce must equal the dense allreduce of the dense tensors its slices stand for.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import keras_ring as kr
from tests.reference import REDUCE_DTYPES, OP_NAMES, assert_same, np_dtype, rank_input, reduce_reference

# (prescale, postscale): identity, halves, negatives, factors inexact in binary (0.7 is
# 0.69999999 as a 32-bit float: integers multiplied by it truncate one lower).
SCALES = [(1.0, 1.0), (0.5, 1.0), (1.0, 0.5), (2.0, -1.5), (0.3, 3.0), (0.7, -1.0)]
ROWS, WIDTH = 7, 3


def close_or_same(got: np.ndarray, want: np.ndarray, dtype: tf.DType, bound: np.ndarray) -> None:
    """Integers exactly; floats within a few roundings of the largest magnitude involved
    (``bound``: the reference computed on absolute values), since the order of the sums and
    where the dtype rounds differ from NumPy's float64."""
    if dtype.is_integer:
        assert_same(got, want)
        return
    eps = {tf.float16: 2.0**-10, tf.bfloat16: 2.0**-7, tf.float32: 2.0**-23}.get(dtype, 2.0**-52)
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    assert np.all(err <= 8 * eps * np.abs(bound.astype(np.float64))), (got, want)


def magnitude(inputs: list[np.ndarray], op: str, pre: float, post: float) -> np.ndarray:
    """How large the terms of a linear reduction get (for Min/Max/Product: the result's)."""
    if op not in ("Sum", "Average"):
        return reduce_reference(inputs, op, tf.float64, pre, post)
    return reduce_reference([np.abs(x.astype(np.float64)) for x in inputs], op, tf.float64,
                            abs(pre), abs(post))


@pytest.mark.parametrize("pre, post", SCALES)
@pytest.mark.parametrize("op", OP_NAMES)
@pytest.mark.parametrize("dtype", REDUCE_DTYPES, ids=lambda d: d.name)
def test_dense_allreduce_and_grouped_scale_like_numpy(world, dtype, op, pre, post):
    rank, size = world
    shapes = [(5,), (2, 9)]
    inputs = [[rank_input(dtype, s, r, seed=31 + i, op=op) for i, s in enumerate(shapes)]
              for r in range(size)]
    single = kr.allreduce(tf.constant(inputs[rank][0]), op=getattr(kr, op),
                          prescale_factor=pre, postscale_factor=post)
    grouped = kr.grouped_allreduce([tf.constant(x) for x in inputs[rank]], op=getattr(kr, op),
                                   prescale_factor=pre, postscale_factor=post)
    for i, got in enumerate([single] + grouped):
        k = max(0, i - 1)
        terms = [x[k] for x in inputs]
        want = reduce_reference(terms, op, dtype, pre, post)
        close_or_same(got.numpy(), want, dtype, magnitude(terms, op, pre, post))


def _slices(dtype: tf.DType, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rank ``rank``'s rows (indices repeat within and across ranks) and the dense tensor
    they stand for (duplicate rows summed; integers wrap)."""
    rng = np.random.default_rng([77, rank])
    indices = rng.integers(0, ROWS, size=5).astype(np.int64)
    values = rank_input(dtype, (5, WIDTH), rank, seed=78)
    dense = np.zeros((ROWS, WIDTH), np_dtype(dtype))
    with np.errstate(over="ignore"):
        np.add.at(dense, indices, values)
    return values, indices, dense


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("pre, post", SCALES)
@pytest.mark.parametrize("op", ["Sum", "Average"])
@pytest.mark.parametrize("dtype", REDUCE_DTYPES, ids=lambda d: d.name)
def test_sparse_allreduce_equals_the_dense_allreduce_it_stands_for(world, dtype, op, pre, post,
                                                                   mode):
    rank, size = world
    parts = [_slices(dtype, r) for r in range(size)]
    values, indices, _ = parts[rank]

    def reduce(v, i):
        return kr.allreduce(tf.IndexedSlices(v, i, tf.constant([ROWS, WIDTH], tf.int64)),
                            op=getattr(kr, op), prescale_factor=pre, postscale_factor=post,
                            name="sparse")

    fn = reduce if mode == "eager" else tf.function(reduce)
    out = fn(tf.constant(values), tf.constant(indices))
    assert isinstance(out, tf.IndexedSlices)
    got = tf.convert_to_tensor(out).numpy()
    terms = [p[2] for p in parts]
    want = reduce_reference(terms, op, dtype, pre, post)
    close_or_same(got, want, dtype, magnitude(terms, op, pre, post))


def test_integer_sparse_average_of_the_reported_case(world):
    # int32 rows [[5, 7]] and [[9, 3]] at index 0 on two ranks used to average to [[0, 0]].
    rank, size = world
    rows = [np.array([[5, 7]], np.int32) + 4 * r for r in range(size)]
    out = kr.allreduce(tf.IndexedSlices(tf.constant(rows[rank]), tf.constant([0], tf.int64),
                                        tf.constant([1, 2], tf.int64)), op=kr.Average)
    want = np.trunc(np.sum(rows, axis=0) / size).astype(np.int32)
    assert_same(tf.convert_to_tensor(out).numpy(), want)
