"""NCCL's own one-rank allreduce, called directly (no keras_ring): whether NCCL still leaves
the tail unwritten that keras_ring works around (OneRankPieces in
keras_ring/ops/cc/core/nccl/plan.h), and whether what it writes is what that comment's model
of its kernel says, over many lengths. Informational: gpu_check.sh prints the summary lines;
keras_ring's own results at such lengths are checked by gpu_check.py (cut_counts).

    python3 benchmarks/gpu_check_nccl_one_rank.py DIRECTORY_OF_LIBNCCL"""
from __future__ import annotations

import ctypes
import sys

import numpy as np

BLOCK_BYTES, MAX_BLOCKS, PACK_BYTES = 16 << 10, 32, 16  # as plan.cc models the kernel


def kernel_writes(count: int, element_bytes: int) -> int:
    """The elements NCCL 2.28's one-rank kernel writes of `count` (plan.cc's OneRankKernelWrites)."""
    blocks = min(MAX_BLOCKS, -(-count * element_bytes // BLOCK_BYTES))
    if blocks == 0:
        return count
    pack = max(1, PACK_BYTES // element_bytes)
    share = -(-(count // blocks) // pack) * pack
    return min(count, blocks * share)


def cut_counts(element_bytes: int, k: int, seed: int = 0, max_bytes: int = 3 << 20) -> list[int]:
    """k lengths (sorted, deterministic, under max_bytes) whose tail that kernel leaves."""
    rng = np.random.default_rng([seed, element_bytes])
    found: set[int] = set()
    while len(found) < k:
        count = int(rng.integers(2, max_bytes // element_bytes))
        if kernel_writes(count, element_bytes) < count:
            found.add(count)
    return sorted(found)


class Nccl:
    """One rank's communicator through ctypes."""

    class UniqueId(ctypes.Structure):
        _fields_ = [("internal", ctypes.c_char * 128)]

    def __init__(self, directory: str):
        self.lib = ctypes.CDLL(directory + "/libnccl.so.2")
        uid = self.UniqueId()
        assert self.lib.ncclGetUniqueId(ctypes.byref(uid)) == 0
        self.comm = ctypes.c_void_p()
        assert self.lib.ncclCommInitRank(ctypes.byref(self.comm), 1, uid, 0) == 0
        version = ctypes.c_int(0)
        self.lib.ncclGetVersion(ctypes.byref(version))
        self.version = version.value

    def premul(self, code: int, ctype, scalar: float) -> int:
        op, s = ctypes.c_int(0), ctype(scalar)
        r = self.lib.ncclRedOpCreatePreMulSum(ctypes.byref(op), ctypes.byref(s), code, 1, self.comm)
        assert r == 0, r
        return op.value

    def allreduce(self, cp, x, y, count: int, code: int, op: int, stream) -> int:
        cp.cuda.Device().synchronize()
        r = self.lib.ncclAllReduce(ctypes.c_void_p(x.data.ptr), ctypes.c_void_p(y.data.ptr),
                                   ctypes.c_size_t(count), code, op, self.comm,
                                   ctypes.c_void_p(stream.ptr))
        cp.cuda.Device().synchronize()
        return r


TYPES = {"float32": (np.float32, 7, ctypes.c_float), "float16": (np.float16, 6, None),
         "float64": (np.float64, 8, ctypes.c_double), "int32": (np.int32, 2, ctypes.c_int32)}


def matrix(cp, nccl: Nccl, stream) -> None:
    """Every dtype, op and placement at a few lengths: which are wrong."""
    cases = differ = 0
    for name, (dt, code, ctype) in TYPES.items():
        ops = {"sum": (0, 1.0), "avg": (4, 1.0)}
        if ctype is not None and name != "int32":
            ops["premul1"] = (nccl.premul(code, ctype, 1.0), 1.0)
            ops["premul0.5"] = (nccl.premul(code, ctype, 0.5), 0.5)
        for count in (1000, 4096, 65536, 262144, 524288, 1 << 20, (1 << 20) + 7, 1 << 22):
            for opname, (op, factor) in ops.items():
                for inplace in (False, True):
                    host = np.random.default_rng(count).integers(-50, 51, count).astype(dt)
                    x = cp.asarray(host)
                    y = x if inplace else cp.full(count, -7, dt)
                    r = nccl.allreduce(cp, x, y, count, code, op, stream)
                    got = cp.asnumpy(y).astype(np.float64)
                    bad = np.flatnonzero(got != host.astype(np.float64) * factor)
                    cases += 1
                    differ += bool(r != 0 or bad.size)
                    if r != 0 or bad.size:
                        i = int(bad[0]) if bad.size else 0
                        print(f"DIFF {name} {opname} x{count} {'in' if inplace else 'out of'} "
                              f"place: rc {r}, {bad.size} differ from [{i}]", flush=True)
    print(f"NCCL {nccl.version} itself, one rank: {differ} of {cases} reductions wrong"
          + (" (keras_ring splits such calls)" if differ else ""), flush=True)


def model_check(cp, nccl: Nccl, stream) -> None:
    """Average out of place at lengths the model says are cut and at others: does NCCL write
    exactly the model's prefix and leave the rest as it was?"""
    total = agree = 0
    for name, (dt, code, _) in TYPES.items():
        if name == "int32":
            continue
        esize = np.dtype(dt).itemsize
        rng = np.random.default_rng(esize)
        counts = cut_counts(esize, 40) + [int(c) for c in rng.integers(2, (3 << 20) // esize, 20)]
        for count in counts:
            host = (np.arange(count) % 97 + 1).astype(dt)
            x = cp.asarray(host)
            y = cp.full(count, -7, dt)
            nccl.allreduce(cp, x, y, count, code, 4, stream)
            got = cp.asnumpy(y)
            right = got == host
            written = count if right.all() else int(np.argmin(right))
            untouched = bool((got[written:] == -7).all())
            expected = kernel_writes(count, esize)
            total += 1
            agree += written == expected and untouched
            if written != expected or not untouched:
                print(f"MODEL {name} x{count}: NCCL wrote {written}, the model says {expected}"
                      f"{'' if untouched else ', and the rest is not untouched'}", flush=True)
    print(f"NCCL {nccl.version}, one rank: the model in plan.h predicted what it wrote for "
          f"{agree} of {total} lengths", flush=True)


def main() -> None:
    import cupy as cp

    nccl = Nccl(sys.argv[1])
    stream = cp.cuda.Stream(non_blocking=True)
    matrix(cp, nccl, stream)
    model_check(cp, nccl, stream)


if __name__ == "__main__":
    main()
