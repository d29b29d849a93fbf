"""gpu_check's reducescatter and alltoall on a GPU: NCCL's results (a grouped ncclReduce for
uneven parts, ncclReduceScatter for even ones; grouped ncclSend/ncclRecv) against NumPy
references that follow the host runtime's definitions, every rank checking its own part.
The references and the case plans are unit-tested (tests/unit/test_gpu_check.py); the rest
needs CuPy and a GPU. Sizes are small but for one large case each, so the whole stays a few
seconds within gpu_check's one run.
"""

from __future__ import annotations

import ctypes

import numpy as np

SCATTER_TYPES = ("float32", "float16", "bfloat16", "float64", "int8", "uint8", "int32", "int64")
ALLTOALL_TYPES = ("float32", "bool", "int64", "float16", "uint8", "bfloat16")
ROW_ELEMS = 5


# ---------------------------------------------------------------- pure logic (unit-tested)

def scatter_rows(rows: int, n: int) -> list[int]:
    """Rows of each rank's part: the first rows % n ranks get one more (Horovod's split)."""
    return [rows // n + (1 if r < rows % n else 0) for r in range(n)]


def scatter_row_counts(n: int) -> tuple[int, ...]:
    """Even (one ncclReduceScatter), uneven (grouped ncclReduce), and fewer rows than ranks
    (empty parts, skipped)."""
    return tuple(dict.fromkeys((3 * n, 3 * n + 1, max(n - 1, 1))))


def reference_reducescatter(gc, name: str, op: str, inputs: list[np.ndarray], rank: int,
                            prescale: float = 1.0, postscale: float = 1.0) -> np.ndarray:
    """Rank `rank`'s rows of the allreduce of `inputs` (each [rows, ...])."""
    full = gc.reference_allreduce(name, op, inputs, prescale, postscale)
    rows = scatter_rows(inputs[0].shape[0], len(inputs))
    start = sum(rows[:rank])
    return full[start:start + rows[rank]]


def alltoall_splits(case: str, n: int) -> list[list[int]] | None:
    """Every rank's splits for a case (None: equal parts without splits). `row[p]` rows go to p."""
    if case == "equal":
        return None
    if case == "uneven":  # every pattern of 0..3 rows, including sends to oneself
        return [[(r + 2 * p) % 4 for p in range(n)] for r in range(n)]
    if case == "silent":  # rank 0 sends nothing; the others send it something
        return [[0] * n] + [[1 + p for p in range(n)] for _ in range(1, n)]
    if case == "large":
        return [[(1 << 14) + 64 * p + r for p in range(n)] for r in range(n)]
    raise ValueError(case)


def rows_to_send(splits: list[list[int]] | None, rank: int, n: int) -> int:
    return 2 * n if splits is None else sum(splits[rank])


def reference_alltoall(inputs: list[np.ndarray], splits: list[list[int]] | None,
                       rank: int) -> tuple[np.ndarray, list[int]]:
    """What rank `rank` receives: the rows each rank addressed to it, in rank order, and how
    many came from each."""
    n = len(inputs)
    if splits is None:
        splits = [[x.shape[0] // n] * n for x in inputs]
    parts = []
    for p, x in enumerate(inputs):
        start = sum(splits[p][:rank])
        parts.append(x[start:start + splits[p][rank]])
    return np.concatenate(parts), [splits[p][rank] for p in range(n)]


# ---------------------------------------------------------------- the C API and the checks

def load(core_class, dtypes: dict, ops: dict) -> None:
    """Adds reducescatter and alltoall to gpu_check's Core."""
    vp, i64, i, d = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double
    tail = [vp, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]

    def declare(c) -> None:
        c.keras_ring_device_reducescatter.argtypes = [vp, vp, i64, i64, i, i, d, d, i] + tail
        c.keras_ring_device_alltoall.argtypes = [
            vp, vp, i64, i64, i64, ctypes.POINTER(i64), i, ctypes.POINTER(ctypes.c_int32), i,
            i] + tail

    def reducescatter(self, x, y, name, op, device, pre=1.0, post=1.0, stream=0):
        declare(self.c)
        rows = x.shape[0]
        self._check(self.c.keras_ring_device_reducescatter(
            x.data.ptr, y.data.ptr, rows, int(np.prod(x.shape[1:])), dtypes[name], ops[op], pre, post,
            device, stream, None, self.err, len(self.err)))

    def alltoall(self, x, out, name, splits, device, stream=0):
        declare(self.c)
        n = len(splits) if splits is not None else 0
        received = (ctypes.c_int32 * 64)()
        self._check(self.c.keras_ring_device_alltoall(
            x.data.ptr, out.data.ptr, x.shape[0], int(np.prod(x.shape[1:])), out.shape[0],
            (i64 * n)(*splits) if n else None, n, received, dtypes[name], device, stream, None,
            self.err, len(self.err)))
        return list(received)

    core_class.reducescatter = reducescatter
    core_class.alltoall = alltoall


def check_reducescatter(gc, core, cp, checks, rank: int, n: int, device: int) -> None:
    cases = [(name, op, rows, 1.0, 1.0) for name in SCATTER_TYPES for op in gc.OPS
             for rows in scatter_row_counts(n) if not (name == "bfloat16" and op == "Product")]
    cases += [("float32", "Average", 3 * n + 1, 0.5, 3.0), ("float16", "Sum", 3 * n, 0.25, 2.0),
              ("bfloat16", "Average", n - 1 or 1, 2.0, 1.0), ("float32", "Sum", (1 << 16) + 1, 1.0, 1.0),
              ("float32", "Average", (1 << 16) + 1, 1.0, 1.0)]  # a one-rank NCCL kernel's tail
    for name, op, rows, pre, post in cases:
        inputs = [gc.rank_input(name, op, rows * ROW_ELEMS, r).reshape(rows, ROW_ELEMS)
                  for r in range(n)]
        x = cp.asarray(inputs[rank])
        y = cp.empty((scatter_rows(rows, n)[rank], ROW_ELEMS), gc.storage_dtype(name))
        what = f"reducescatter {op} {name} rows {rows} pre={pre} post={post}"
        if gc.run_collective(checks, what, lambda: core.reducescatter(x, y, name, op, device, pre, post)):
            want = reference_reducescatter(gc, name, op, inputs, rank, pre, post)
            checks.expect(what, gc.close(name, cp.asnumpy(y), want))
    # Not foldable into NCCL's pre-multiplication: refused on every rank, nothing breaks.
    x = cp.ones((n, 2), cp.float32)
    y = cp.empty((1, 2), cp.float32)
    try:
        core.reducescatter(x, y, "float32", "Max", device, pre=2.0)
        checks.expect("reducescatter Max with prescale is refused", False, "it ran")
    except gc.CollectiveError as e:
        checks.expect("reducescatter Max with prescale is refused", e.code == 3, str(e))


def check_alltoall(gc, core, cp, checks, rank: int, n: int, device: int) -> None:
    for case in ("equal", "uneven", "silent", "large"):
        splits = alltoall_splits(case, n)
        for name in ALLTOALL_TYPES if case != "large" else ("float32",):
            inputs = [gc.rank_input(name, "Sum", rows_to_send(splits, r, n) * ROW_ELEMS, r)
                      .reshape(-1, ROW_ELEMS) for r in range(n)]
            want, want_received = reference_alltoall(inputs, splits, rank)
            x = cp.asarray(inputs[rank])
            out = cp.empty((max(want.shape[0], 1), ROW_ELEMS), gc.storage_dtype(name))
            what = f"alltoall {name} {case} splits"
            got = []
            mine = splits[rank] if splits is not None else None
            if gc.run_collective(checks, what, lambda: got.append(core.alltoall(x, out, name, mine, device))):
                checks.expect(what, gc.close(name, cp.asnumpy(out[:want.shape[0]]), want)
                              and got[0][:n] == want_received, f"received {got[0][:n]}")
    # One rank's splits do not add up to its rows: every rank refuses, naming it.
    x = cp.ones((n, 2), cp.float32)
    out = cp.empty((2 * n, 2), cp.float32)
    bad = [1] * n if rank != n - 1 else [0] * n
    try:
        core.alltoall(x, out, "float32", bad, device)
        checks.expect("alltoall with bad splits on one rank is refused", False, "it ran")
    except gc.CollectiveError as e:
        checks.expect("alltoall with bad splits on one rank is refused",
                      e.code == 3 and f"rank {n - 1} passed splits" in str(e), str(e))
