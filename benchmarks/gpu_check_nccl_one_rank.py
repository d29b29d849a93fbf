"""NCCL's own one-rank allreduce, called directly (no keras_ring), by dtype, op, size and
placement: whether NCCL still leaves a tail unwritten that keras_ring works around (the
OneRankPieces comment in keras_ring/ops/cc/core/nccl/plan.h). Informational: gpu_check.sh
prints the summary line; keras_ring's own results are checked by gpu_check.py.

    python3 benchmarks/gpu_check_nccl_one_rank.py DIRECTORY_OF_LIBNCCL"""
import ctypes
import sys

import cupy as cp
import numpy as np

nccl = ctypes.CDLL(sys.argv[1] + "/libnccl.so.2")


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


uid = UniqueId()
assert nccl.ncclGetUniqueId(ctypes.byref(uid)) == 0
comm = ctypes.c_void_p()
assert nccl.ncclCommInitRank(ctypes.byref(comm), 1, uid, 0) == 0
TYPES = {"float32": (np.float32, 7, ctypes.c_float), "float16": (np.float16, 6, None),
         "float64": (np.float64, 8, ctypes.c_double), "int32": (np.int32, 2, ctypes.c_int32)}


def premul(code, ctype, scalar):
    op = ctypes.c_int(0)
    s = ctype(scalar)
    r = nccl.ncclRedOpCreatePreMulSum(ctypes.byref(op), ctypes.byref(s), code, 1, comm)
    assert r == 0, r
    return op.value


stream = cp.cuda.Stream(non_blocking=True)
cases = differ = 0
for name, (dt, code, ctype) in TYPES.items():
    ops = {"sum": (0, 1.0), "avg": (4, 1.0)}
    if ctype is not None and name != "int32":
        ops["premul1"] = (premul(code, ctype, 1.0), 1.0)
        ops["premul0.5"] = (premul(code, ctype, 0.5), 0.5)
    for count in (1000, 4096, 65536, 262144, 524288, 1 << 20, (1 << 20) + 7, 1 << 22):
        for opname, (op, factor) in ops.items():
            for inplace in (False, True):
                host = np.random.default_rng(count).integers(-50, 51, count).astype(dt)
                x = cp.asarray(host)
                y = x if inplace else cp.full(count, -7, dt)
                cp.cuda.Device().synchronize()
                r = nccl.ncclAllReduce(ctypes.c_void_p(x.data.ptr), ctypes.c_void_p(y.data.ptr),
                                       ctypes.c_size_t(count), code, op, comm,
                                       ctypes.c_void_p(stream.ptr))
                cp.cuda.Device().synchronize()
                got = cp.asnumpy(y).astype(np.float64)
                want = host.astype(np.float64) * factor
                bad = np.flatnonzero(got != want)
                cases += 1
                differ += bool(r != 0 or bad.size)
                if r != 0 or bad.size:
                    i, j = (int(bad[0]), int(bad[-1])) if bad.size else (0, 0)
                    print(f"DIFF {name} {opname} x{count} {'in' if inplace else 'out of'} place:"
                          f" rc {r}, {bad.size} differ, {i}..{j}, [{i}] {got[i]} vs {want[i]}",
                          flush=True)
version = ctypes.c_int(0)
nccl.ncclGetVersion(ctypes.byref(version))
print(f"NCCL {version.value} itself, one rank: {differ} of {cases} reductions wrong"
      + (" (keras_ring splits such calls)" if differ else ""), flush=True)
