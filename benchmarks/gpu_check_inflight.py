"""gpu_check's measurement of NCCL collectives in flight: the host-side cost per collective
with 1 and with 64 outstanding, through the real NCCL (the same measurement as
build/nccl_host_cost through the C++ tests' fake GPU; see docs/performance.md).

Each rank submits ALLREDUCES small in-place allreduces through keras_ring_device_allreduce_window,
keeping WINDOW of them outstanding; 1 means each waits for the previous one's completion (what a
synchronous caller pays), 64 means the runtime keeps up to its device_max_in_flight (64) on the
stream and completes them off the worker. First a correctness pass: every buffer holds the
reduction once all completed.
"""

from __future__ import annotations

import ctypes
import time

ALLREDUCES = 2000
COUNT = 256  # float32 elements: 1 KiB, so the GPU's own time is small next to the host's
WINDOWS = (1, 64)
REPEATS = 3


def in_flight_table(results: dict[int, list[float]], n: int) -> str:
    """Rank 0's table: microseconds per collective for each window, every repeat."""
    lines = [f"# NCCL allreduce of {COUNT * 4} B, {n} ranks, {ALLREDUCES} back to back: host-side "
             "cost per collective (us), by collectives outstanding",
             "# in flight   us/collective (each repeat)"]
    for window in sorted(results):
        lines.append(f"{window:11d}   " + " ".join(f"{us:8.1f}" for us in results[window]))
    return "\n".join(lines)


def load(core_class) -> None:
    """Adds allreduce_window to gpu_check's Core."""
    vp, i64, i, d = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double

    def allreduce_window(self, buffers, count: int, dtype: int, op: int, n: int, window: int,
                         device: int, stream=0) -> float:
        c = self.c
        c.keras_ring_device_allreduce_window.argtypes = [
            ctypes.POINTER(vp), i, i64, i, i, i, i, i, vp, ctypes.POINTER(d), ctypes.c_char_p,
            ctypes.c_size_t]
        seconds = ctypes.c_double(0.0)
        k = len(buffers)
        self._check(c.keras_ring_device_allreduce_window(
            (vp * k)(*[b.data.ptr for b in buffers]), k, count, dtype, op, n, window, device,
            stream, ctypes.byref(seconds), self.err, len(self.err)))
        return seconds.value

    def agreement_rounds(self) -> int:
        rounds = ctypes.c_int64(0)
        self.c.keras_ring_device_agreement_rounds.argtypes = [ctypes.POINTER(ctypes.c_int64)]
        self.c.keras_ring_device_agreement_rounds(ctypes.byref(rounds))
        return rounds.value

    core_class.allreduce_window = allreduce_window
    core_class.agreement_rounds = agreement_rounds


def control_round_trip_us(core, iterations: int = ALLREDUCES) -> list[float]:
    """Microseconds per barrier, REPEATS times: the agreement's round trip between the ranks
    alone (CPU only), to set against the host cost per NCCL collective above."""
    runs = []
    for _ in range(REPEATS):
        core.barrier()
        start = time.perf_counter()
        for _ in range(iterations):
            core.barrier()
        runs.append((time.perf_counter() - start) / iterations * 1e6)
    return runs


def check_in_flight(gc, core, cp, checks, rank: int, n: int, device: int) -> dict:
    """Results of 256 allreduces 64 in flight, then the timing table; at 2 ranks or more, that
    collectives 64 in flight were agreed in at most half as many rounds (the lookahead)."""
    dtype, op = gc.DTYPES["float32"], gc.OPS["Max"]  # Max: buffers keep their value
    buffers = [cp.full(COUNT, rank + 1 + i, cp.float32) for i in range(64)]
    core.allreduce_window(buffers, COUNT, dtype, op, 256, 64, device)
    cp.cuda.runtime.deviceSynchronize()
    checks.expect("256 allreduces 64 in flight: results",
                  all(float(b.min()) == float(b.max()) == n + i for i, b in enumerate(buffers)))
    results: dict[int, list[float]] = {}
    rounds: dict[int, int] = {}
    for window in WINDOWS:
        results[window] = []
        before = core.agreement_rounds()
        for _ in range(REPEATS):
            core.barrier()
            start = time.perf_counter()
            core.allreduce_window(buffers, COUNT, dtype, op, ALLREDUCES, window, device)
            cp.cuda.runtime.deviceSynchronize()
            results[window].append((time.perf_counter() - start) / ALLREDUCES * 1e6)
        rounds[window] = core.agreement_rounds() - before
    if n > 1:
        # Queued collectives are agreed by one round's lookahead (lookahead.cc), not one each.
        collectives = REPEATS * ALLREDUCES
        checks.expect(f"{max(WINDOWS)} in flight: agreed in fewer rounds than collectives",
                      rounds[max(WINDOWS)] <= collectives // 2,
                      f"{rounds[max(WINDOWS)]} rounds for {collectives} collectives")
    barrier_us = control_round_trip_us(core)
    if rank == 0:
        print(in_flight_table(results, n), flush=True)
        print(f"# barrier, the control path alone (us, each repeat): "
              + " ".join(f"{us:.1f}" for us in barrier_us), flush=True)
        print("# agreement rounds for " + ", ".join(
            f"{REPEATS * ALLREDUCES} collectives {w} in flight: {r}" for w, r in rounds.items()),
            flush=True)
    return {"in_flight_us": {str(w): v for w, v in results.items()}, "barrier_us": barrier_us,
            "agreement_rounds": {str(w): r for w, r in rounds.items()}}
