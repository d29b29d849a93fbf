"""Seeded inputs and numpy references shared by the single-process and parallel tests.

Every rank generates every rank's input from the same seed, so each can compute the expected
result of a collective locally, without communication.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

REDUCE_DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int8, tf.uint8, tf.int16,
                 tf.uint16, tf.int32, tf.int64]
GATHER_DTYPES = REDUCE_DTYPES + [tf.bool]
OP_NAMES = ["Sum", "Average", "Min", "Max", "Product"]


def np_dtype(dtype: tf.DType):
    return dtype.as_numpy_dtype


def rank_input(dtype: tf.DType, shape, rank: int, seed: int, op: str = "Sum") -> np.ndarray:
    """Integer-valued data, so float sums and products are exact in every dtype and order.

    8- and 16-bit integer sums use large values on purpose: they must wrap like the hardware.
    """
    rng = np.random.default_rng([seed, rank])
    if dtype == tf.bool:
        return rng.integers(0, 2, size=shape).astype(bool)
    if op == "Product":
        unsigned = dtype in (tf.uint8, tf.uint16)
        values = rng.choice([1, 2, 3] if unsigned else [-1, 1, 2], size=shape)
    elif dtype == tf.int8:
        values = rng.integers(-100, 100, size=shape)
    elif dtype == tf.uint8:
        values = rng.integers(0, 200, size=shape)
    elif dtype == tf.int16:
        values = rng.integers(-20000, 20000, size=shape)
    elif dtype == tf.uint16:
        values = rng.integers(0, 40000, size=shape)
    else:
        values = rng.integers(-8, 9, size=shape)
    return np.asarray(values).astype(np_dtype(dtype))


def reduce_reference(inputs: list[np.ndarray], op: str, dtype: tf.DType,
                     prescale: float = 1.0, postscale: float = 1.0) -> np.ndarray:
    """What keras_ring documents: integers wrap, Average of integers truncates toward zero."""
    nd = np_dtype(dtype)
    n = len(inputs)
    is_int = dtype.is_integer
    if is_int:
        stack = np.stack([_scale_int(x, prescale, nd) for x in inputs])
        with np.errstate(over="ignore"):
            if op in ("Sum", "Average"):
                out = np.sum(stack, axis=0, dtype=nd)
            elif op == "Product":
                out = np.prod(stack, axis=0, dtype=nd)
            elif op == "Min":
                out = np.min(stack, axis=0)
            else:
                out = np.max(stack, axis=0)
        if op == "Average" and postscale != 1.0:  # sum * (postscale / n), truncated once
            return _scale_int(out, postscale / n, nd)
        if op == "Average":  # integer division toward zero, exact at any magnitude
            out = np.array([int(v) // n if v >= 0 else -(-int(v) // n) for v in out.ravel()],
                           dtype=nd).reshape(out.shape)
        return _scale_int(out, postscale, nd)
    stack = np.stack([x.astype(np.float64) * prescale for x in inputs])
    if op in ("Sum", "Average"):
        out = np.sum(stack, axis=0)
    elif op == "Product":
        out = np.prod(stack, axis=0)
    elif op == "Min":
        out = np.min(stack, axis=0)
    else:
        out = np.max(stack, axis=0)
    # The reduction runs in the tensor's dtype: past its range the result is inf before the
    # postscale can bring it back (float16 Product at 8 ranks, prescale 2: 4**8 = 65536).
    # The inputs keep every partial sum and product in range where the final one is.
    with np.errstate(over="ignore"):
        overflowed = np.isfinite(out) & ~np.isfinite(out.astype(nd))
    out = np.where(overflowed, np.copysign(np.inf, out), out)
    if op == "Average":  # keras_ring scales by postscale / n in one multiplication
        return (out * (postscale / n)).astype(nd)
    return (out * postscale).astype(nd)


def _scale_int(x: np.ndarray, factor: float, nd) -> np.ndarray:
    if factor == 1.0:
        return x
    # The library's rule: truncate, saturate at the dtype's bounds as doubles (for int64 the
    # upper one rounds up to 2**63, which must not be cast), NaN gives 0.
    info = np.iinfo(nd)
    v = np.trunc(x.astype(np.float64) * factor)
    out = np.where(v <= float(info.min), info.min, info.max).astype(nd)
    inside = (v > float(info.min)) & (v < float(info.max))
    out[inside] = v[inside].astype(nd)
    out[np.isnan(v)] = 0
    return out


def assert_same(actual, expected) -> None:
    """Exact equality, NaN equal to NaN, dtype included."""
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if actual.dtype.kind == "f" or actual.dtype.name == "bfloat16":
        a = actual.astype(np.float64)
        e = expected.astype(np.float64)
        assert np.array_equal(a, e, equal_nan=True), f"\nactual:   {a}\nexpected: {e}"
    else:
        assert np.array_equal(actual, expected), f"\nactual:   {actual}\nexpected: {expected}"
