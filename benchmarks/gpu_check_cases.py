"""gpu_check's further checks on a GPU, beside the per-collective ones in gpu_check.py:
grouped allreduce, edge cases, the first collective's latency, many small collectives with
stable GPU memory and backend objects, which CUDA and NCCL libraries were loaded, and that
each process holds a CUDA context only on its own GPU. The pure parts are unit-tested
(tests/unit/test_gpu_check.py); the rest needs CuPy and a GPU.
"""

from __future__ import annotations

import ctypes
import subprocess
import time

import numpy as np

# A grouped allreduce's members: mixed dtypes, an empty member, a scalar-sized one.
GROUP = (("float32", 1000), ("float16", 7), ("bfloat16", 33), ("int32", 5), ("float32", 0),
         ("float64", 1), ("uint8", 64))
# Scale factors fold into one NCCL pre-multiplication, for float members only.
# 40003 float32: one rank's NCCL kernel leaves a tail of such a count unwritten (plan.h).
SCALED_GROUP = (("float16", 100), ("bfloat16", 64), ("float32", 0), ("float32", 3),
                ("float32", 40003))
STABLE_ITERATIONS = 10_000
MEMORY_DRIFT_BYTES = 64 << 20  # NCCL may grow a little once; a leak per call would be far more


def mapped_libraries(maps: str) -> dict[str, list[str]]:
    """The libcudart / libnccl files mapped into a process, from /proc/<pid>/maps text."""
    found: dict[str, list[str]] = {"libcudart": [], "libnccl": []}
    for line in maps.splitlines():
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        for name, paths in found.items():
            if path.rsplit("/", 1)[-1].startswith(name + ".so") and path not in paths:
                paths.append(path)
    return found


def bus_id(text: str) -> str:
    """A PCI bus id without its domain, lower case: '00000000:19:00.0' -> '19:00.0'."""
    return text.strip().lower().split(":", 1)[-1]


def foreign_gpus(smi_rows: str, pid: int, own_bus: str) -> list[str] | None:
    """Bus ids of GPUs other than `own_bus` where `pid` holds a context, from
    `nvidia-smi --query-compute-apps=pid,gpu_bus_id --format=csv,noheader`; None when the
    listing does not show `pid` at all (a container's own PID namespace)."""
    mine = []
    for row in smi_rows.splitlines():
        fields = [f.strip() for f in row.split(",")]
        if len(fields) >= 2 and fields[0] == str(pid):
            mine.append(bus_id(fields[1]))
    if not mine:
        return None
    return sorted({b for b in mine if b != bus_id(own_bus)})


def memory_stable(free_before: int, free_after: int) -> bool:
    return free_before - free_after <= MEMORY_DRIFT_BYTES


def group_inputs(gc, members, rank: int, op: str = "Sum") -> list[np.ndarray]:
    return [gc.rank_input(name, op, count, rank, seed=i) for i, (name, count) in enumerate(members)]


def group_reference(gc, members, inputs_by_rank, op, pre=1.0, post=1.0) -> list[np.ndarray]:
    return [gc.reference_allreduce(name, op, [inputs[i] for inputs in inputs_by_rank], pre, post)
            for i, (name, _) in enumerate(members)]


def check_first_latency(core, cp, rank: int, device: int) -> dict:
    """Must be the first collective: it makes the communicator (and NCCL >= 2.22 connects
    peers lazily inside it)."""
    x = cp.ones(1, cp.float32)
    times = []
    for _ in range(2):
        start = time.perf_counter()
        core.allreduce(x, x, "float32", "Sum", device)
        times.append(time.perf_counter() - start)
    if rank == 0:
        print(f"# first collective (communicator setup included): {times[0] * 1e3:.1f} ms; "
              f"the next: {times[1] * 1e6:.0f} us", flush=True)
    return {"first_ms": times[0] * 1e3, "second_us": times[1] * 1e6}


def check_grouped(gc, core, cp, checks, rank: int, n: int, device: int) -> None:
    for members, op, pre, post in ((GROUP, "Sum", 1.0, 1.0), (GROUP, "Max", 1.0, 1.0),
                                   (SCALED_GROUP, "Average", 0.5, 3.0),
                                   (SCALED_GROUP, "Sum", 0.25, 2.0)):
        by_rank = [group_inputs(gc, members, r, op) for r in range(n)]
        xs = [cp.asarray(a) for a in by_rank[rank]]
        ys = [cp.empty_like(x) for x in xs]
        what = f"grouped allreduce {op} pre={pre} post={post} of " + \
            ", ".join(f"{name}x{count}" for name, count in members)
        if gc.run_collective(checks, what, lambda: core.grouped_allreduce(
                xs, ys, [name for name, _ in members], op, device, pre=pre, post=post)):
            want = group_reference(gc, members, by_rank, op, pre, post)
            ok = all(gc.close(name, cp.asnumpy(y), w) for (name, _), y, w in zip(members, ys, want))
            checks.expect(what, ok)
    # Integers cannot carry a scale factor on NCCL: refused alike, and nothing breaks.
    xs = [cp.ones(4, cp.float32), cp.ones(4, cp.int32)]
    try:
        core.grouped_allreduce(xs, xs, ["float32", "int32"], "Sum", device, pre=2.0)
        checks.expect("grouped allreduce with an int32 member and prescale is refused", False)
    except gc.CollectiveError as e:
        checks.expect("grouped allreduce with an int32 member and prescale is refused",
                      e.code == 3, str(e))


def check_edge_cases(gc, core, cp, checks, rank: int, n: int, device: int) -> None:
    empty = cp.empty(0, cp.float32)
    what = "allreduce and broadcast of empty tensors"
    if gc.run_collective(checks, what, lambda: (core.allreduce(empty, empty, "float32", "Sum", device),
                                                core.broadcast(empty, empty, "float32", 0, device))):
        checks.expect(what, True)
    scalar = cp.asarray(np.float64(rank + 1))  # shape (): one element
    if gc.run_collective(checks, "allreduce of a scalar",
                         lambda: core.allreduce(scalar, scalar, "float64", "Sum", device)):
        checks.expect("allreduce of a scalar", float(scalar) == n * (n + 1) / 2, str(scalar))
    for rows_of in (lambda r: 0, lambda r: 0 if r == 0 else 2):
        rows = [rows_of(r) for r in range(n)]
        inputs = [gc.rank_input("float32", "Sum", rows[r] * 3, r).reshape(rows[r], 3) for r in range(n)]
        out = cp.empty((max(sum(rows), 1), 3), cp.float32)
        x = cp.asarray(inputs[rank]) if rows[rank] else cp.empty((0, 3), cp.float32)
        what = f"allgather with rows {rows}"
        if gc.run_collective(checks, what, lambda: core.allgather(x, out, "float32", rows[rank], 3, device)):
            got = cp.asnumpy(out[:sum(rows)])
            checks.expect(what, gc.close("float32", got, np.concatenate(inputs)))
    flags = cp.asarray(np.array([rank == 0, True, rank != 0, False]))
    if gc.run_collective(checks, "bool broadcast", lambda: core.broadcast(flags, flags, "bool", 0, device)):
        checks.expect("bool broadcast", cp.asnumpy(flags).tolist() == [True, True, False, False])


def check_many_small(gc, core, cp, checks, rank: int, n: int, device: int) -> dict:
    """10,000 small collectives: neither GPU memory nor the backend's events grow."""
    x = cp.ones(4, cp.float32)
    y = cp.empty_like(x)
    rows = cp.ones((1, 4), cp.float32)
    out = cp.empty((n, 4), cp.float32)
    calls = (lambda: core.allreduce(x, y, "float32", "Sum", device),
             lambda: core.broadcast(x, y, "float32", 0, device),
             lambda: core.allgather(rows, out, "float32", 1, 4, device))
    for i in range(100):
        calls[i % 3]()
    cp.cuda.runtime.deviceSynchronize()
    free_before = cp.cuda.runtime.memGetInfo()[0]
    events_before, comms_before = core.objects()
    start = time.perf_counter()
    for i in range(STABLE_ITERATIONS):
        calls[i % 3]()
    seconds = time.perf_counter() - start
    cp.cuda.runtime.deviceSynchronize()
    free_after = cp.cuda.runtime.memGetInfo()[0]
    events_after, comms_after = core.objects()
    what = f"{STABLE_ITERATIONS} small collectives"
    checks.expect(what + ": GPU memory stable", memory_stable(free_before, free_after),
                  f"free {free_before} -> {free_after} bytes")
    checks.expect(what + ": events and communicators stable",
                  (events_after, comms_after) == (events_before, comms_before),
                  f"events {events_before} -> {events_after}, communicators {comms_before} -> {comms_after}")
    # y holds the last allreduce (Sum of ones: n) or broadcast (1) written to it.
    last_into_y = max(i for i in range(STABLE_ITERATIONS) if i % 3 != 2) % 3
    y_expected = float(n) if last_into_y == 0 else 1.0
    checks.expect(what + ": results", float(cp.asnumpy(out).sum()) == 4 * n
                  and float(y[0]) == y_expected, f"y[0] {float(y[0])}, expected {y_expected}")
    if rank == 0:
        print(f"# {what}: {seconds / STABLE_ITERATIONS * 1e6:.0f} us each; free GPU memory "
              f"{free_before >> 20} -> {free_after >> 20} MiB; events {events_after}", flush=True)
    return {"small_us": seconds / STABLE_ITERATIONS * 1e6, "events": events_after}


def check_process(checks, cp, rank: int, device: int) -> dict:
    """Which libraries this process loaded, and that it has a context only on its GPU."""
    import os

    with open("/proc/self/maps") as f:
        libs = mapped_libraries(f.read())
    print(f"[rank {rank}] loaded: {' '.join(libs['libcudart'] + libs['libnccl'])}", flush=True)
    checks.expect("one libnccl loaded", len(libs["libnccl"]) == 1, str(libs["libnccl"]))
    checks.expect("a libcudart loaded", len(libs["libcudart"]) >= 1, str(libs["libcudart"]))
    own = cp.cuda.runtime.deviceGetPCIBusId(device)
    try:
        rows = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_bus_id",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        rows = ""
    foreign = foreign_gpus(rows, os.getpid(), own)
    if foreign is None:
        print(f"[rank {rank}] contexts: nvidia-smi does not list this process; not checked",
              flush=True)
    else:
        checks.expect("CUDA contexts only on this rank's own GPU", foreign == [], str(foreign))
    return {"libraries": libs, "foreign_contexts": foreign}


def load(core_class, dtypes: dict, ops: dict) -> None:
    """Adds what these checks need to gpu_check's Core: grouped allreduce, object counts."""
    vp, i64, i, d = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double

    def declare(c) -> None:
        c.keras_ring_device_grouped_allreduce.argtypes = [
            ctypes.POINTER(vp), ctypes.POINTER(vp), ctypes.POINTER(i64), ctypes.POINTER(i), i, i,
            d, d, i, vp, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
        c.keras_ring_device_objects.argtypes = [ctypes.POINTER(i64), ctypes.POINTER(i64)]

    def grouped_allreduce(self, xs, ys, names, op, device, stream=0, pre=1.0, post=1.0):
        declare(self.c)
        n = len(xs)
        self._check(self.c.keras_ring_device_grouped_allreduce(
            (vp * n)(*[x.data.ptr for x in xs]), (vp * n)(*[y.data.ptr for y in ys]),
            (ctypes.c_int64 * n)(*[x.size for x in xs]),
            (ctypes.c_int * n)(*[dtypes[name] for name in names]), n, ops[op], pre, post, device,
            stream, None, self.err, len(self.err)))

    def objects(self):
        declare(self.c)
        events, comms = ctypes.c_int64(0), ctypes.c_int64(0)
        self.c.keras_ring_device_objects(ctypes.byref(events), ctypes.byref(comms))
        return events.value, comms.value

    core_class.grouped_allreduce = grouped_allreduce
    core_class.objects = objects
