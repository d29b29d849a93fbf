"""gpu_check's values: keras_ring's dtype and op codes, each rank's inputs, and the results
every rank should get, computed on the host as the runtime defines them (NumPy only, so the
unit tests in tests/unit/test_gpu_check.py run it without a GPU)."""
from __future__ import annotations

import numpy as np

DTYPES = {"float16": 0, "bfloat16": 1, "float32": 2, "float64": 3, "int8": 4, "uint8": 5,
          "int32": 6, "int64": 7, "bool": 8}
OPS = {"Sum": 0, "Average": 1, "Min": 2, "Max": 3, "Product": 4}
CODES = {1: "CANCELLED", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED", 8: "RESOURCE_EXHAUSTED",
         9: "FAILED_PRECONDITION", 10: "ABORTED", 13: "INTERNAL", 14: "UNAVAILABLE"}
# Stop checking: the runtime is broken afterwards (4, 10, 13, 14), or this machine cannot run
# NCCL at all (9: library, driver or device missing), so every later check would fail alike.
FATAL = {4, 9, 10, 13, 14}
RTOL = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-5, "float64": 1e-12}


def storage_dtype(name: str) -> np.dtype:
    """NumPy/CuPy storage of a keras_ring dtype (bfloat16 travels as its uint16 bits)."""
    return np.dtype(np.uint16 if name == "bfloat16" else np.bool_ if name == "bool" else name)


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, rounding to nearest even."""
    b = np.asarray(values, np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_values(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def as_float64(name: str, x: np.ndarray) -> np.ndarray:
    return bf16_values(x).astype(np.float64) if name == "bfloat16" else x.astype(np.float64)


def rank_input(name: str, op: str, count: int, rank: int, seed: int = 0) -> np.ndarray:
    """Rank `rank`'s input: small values whose sums and products stay exact and in range."""
    rng = np.random.default_rng([seed, rank, count, DTYPES[name], OPS.get(op, 9)])
    if name == "bool":
        return rng.integers(0, 2, count).astype(np.bool_)
    if op == "Product":
        values = rng.integers(-2, 3, count) if name in ("int8", "int32", "int64") else \
            rng.integers(1, 3, count) if name == "uint8" else rng.choice([0.5, 1.0, 1.5, 2.0], count)
    elif name == "uint8":
        values = rng.integers(0, 100, count)
    else:
        values = rng.integers(-50, 51, count)
    values = np.asarray(values)
    if name == "bfloat16":
        return bf16_bits(values.astype(np.float32))
    return values.astype(storage_dtype(name))


def reference_allreduce(name: str, op: str, inputs: list[np.ndarray], prescale: float = 1.0,
                        postscale: float = 1.0) -> np.ndarray:
    """What every rank should get, computed like the host runtime defines it."""
    n = len(inputs)
    if name in RTOL:
        v = np.stack([as_float64(name, x) * prescale for x in inputs])
        r = {"Sum": v.sum(0), "Average": v.sum(0) / n, "Min": v.min(0), "Max": v.max(0),
             "Product": v.prod(0)}[op] * postscale
        return bf16_bits(r.astype(np.float32)) if name == "bfloat16" else r.astype(storage_dtype(name))
    v = np.stack([x.astype(np.int64) for x in inputs])
    if op == "Average":  # integer Average divides exactly, truncating toward zero
        s = v.sum(0)
        return (np.sign(s) * (np.abs(s) // n)).astype(storage_dtype(name))
    r = {"Sum": v.sum(0), "Min": v.min(0), "Max": v.max(0), "Product": v.prod(0)}[op]
    return r.astype(storage_dtype(name))  # wraps like the hardware


def close(name: str, got: np.ndarray, want: np.ndarray) -> bool:
    if got.shape != want.shape:
        return False
    if name not in RTOL:
        return bool(np.array_equal(got, want))
    g, w = as_float64(name, got), as_float64(name, want)
    return bool(np.allclose(g, w, rtol=RTOL[name], atol=RTOL[name]))


def mismatch(name: str, got: np.ndarray, want: np.ndarray) -> str:
    """Where `got` differs from `want`: how many elements, the first and last, their values."""
    if got.shape != want.shape:
        return f"shape {got.shape}, expected {want.shape}"
    if name in RTOL:
        g, w = as_float64(name, got).ravel(), as_float64(name, want).ravel()
        bad = np.flatnonzero(~np.isclose(g, w, rtol=RTOL[name], atol=RTOL[name]))
    else:
        g, w = got.ravel(), want.ravel()
        bad = np.flatnonzero(g != w)
    if bad.size == 0:
        return "no element differs"
    first, last = int(bad[0]), int(bad[-1])
    return (f"{bad.size} of {g.size} elements differ, indices {first}..{last}; "
            f"[{first}] got {g[first]} want {w[first]}, [{last}] got {g[last]} want {w[last]}")
