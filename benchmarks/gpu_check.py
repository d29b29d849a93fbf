"""keras_ring's NCCL backend on a GPU machine without TensorFlow: results and bandwidth.

benchmarks/gpu_check.sh builds the core runtime and its C API (no TensorFlow) into
libkeras_ring_core.so and runs this driver on 2 ranks. Each rank checks allreduce (every op,
several dtypes and sizes, scale factors, in place, ordering against a busy caller stream),
allgather (equal and varying rows) and broadcast on CuPy arrays against NumPy, reducescatter
(even, uneven and empty parts) and alltoall (equal, uneven and empty splits, bad splits) of
gpu_check_scatter.py, then the further checks of gpu_check_cases.py (first-collective latency, grouped allreduce, edge
cases, 10,000 small collectives with stable memory, loaded libraries, contexts only on the
rank's own GPU), then rank 0 prints an nccl-tests-style busbw table next to
torch.distributed's NCCL allreduce on the same buffers. `--faults N` then runs the failure
scenarios of gpu_check_faults.py (a killed rank, a stalled GPU, init after shutdown), each a
job of its own. Exit status 0 means every check passed.

    python benchmarks/gpu_check.py --lib build/gpu_check/libkeras_ring_core.so --spawn 2
    mpirun -np 2 python benchmarks/gpu_check.py --lib ...   (ranks found through mpi4py)
    python benchmarks/gpu_check.py --lib ... --faults 2

keras_ring's device C API waits for each collective (its completion thread sees the event),
so its small-message times in the busbw table include that round trip; torch's are
nccl-tests style (back to back). gpu_check_inflight.py measures the host-side cost per
collective with 1 and 64 outstanding (the runtime keeps up to 64 in flight on the stream).
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # keras_ring.ops.loader and keras_ring.gpu import no TensorFlow
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check_cases as cases  # noqa: E402
import gpu_check_faults as faults  # noqa: E402
import gpu_check_inflight as inflight  # noqa: E402
import gpu_check_scatter as scatter  # noqa: E402
from gpu_check_libs import cuda_runtime_dirs, find_nccl, nccl_version_string  # noqa: E402
import gpu_check_nccl_one_rank as one_rank  # noqa: E402
from gpu_check_values import (  # noqa: E402  (also gc.<name> for the check modules)
    CODES, DTYPES, FATAL, OPS, RTOL, as_float64, bf16_bits, bf16_values, close, mismatch,
    rank_input, reference_allreduce, storage_dtype)


# ---------------------------------------------------------------- pure logic (unit-tested)

ITERATION_CAP = 200  # timed calls per size at most; fewer where ranks share a GPU


def iterations(nbytes: int) -> int:
    """Timed calls per size: the same on every rank (no agreement round needed)."""
    cap = ITERATION_CAP
    return int(max(5, min(cap, 2e8 // max(nbytes, 1 << 20) if nbytes > (1 << 20) else cap)))


def control_path(cfg) -> str:
    """How ranks started with native config `cfg` agree on each collective before NCCL runs
    it (KERAS_RING_SHM and KERAS_RING_FAST_AGREE, as for a user's job)."""
    return (f"{'shared memory' if cfg.use_shm else 'TCP'}, "
            f"{'fast' if cfg.fast_agree else 'full'} agreement")


def bandwidths(nbytes: int, seconds: float, n: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s, nccl-tests' definitions for allreduce."""
    algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
    return algbw, algbw * 2 * (n - 1) / n  # one rank moves nothing over a bus: 0


def bench_sizes(max_bytes: int) -> list[int]:
    sizes, s = [], 8
    while s <= max_bytes:
        sizes.append(s)
        s *= 4
    return sizes


def table(rows: list[dict], n: int, torch_label: str | None) -> str:
    head = f"{'bytes':>12} {'elements':>11} | {'keras_ring us':>13} {'algbw':>7} {'busbw':>7}"
    if torch_label:
        head += f" | {torch_label + ' us':>13} {'algbw':>7} {'busbw':>7}"
    lines = [f"# allreduce float32 Sum, {n} ranks, GB/s", head]
    for row in rows:
        line = f"{row['bytes']:>12} {row['bytes'] // 4:>11} | {row['kr_us']:>13.1f} " \
               f"{row['kr_algbw']:>7.2f} {row['kr_busbw']:>7.2f}"
        if torch_label and row.get("torch_us") is not None:
            line += f" | {row['torch_us']:>13.1f} {row['torch_algbw']:>7.2f} {row['torch_busbw']:>7.2f}"
        lines.append(line)
    return "\n".join(lines)


# ---------------------------------------------------------------- ranks and the library

class CollectiveError(RuntimeError):
    def __init__(self, code: int, message: str):
        super().__init__(f"{CODES.get(code, code)}: {message}")
        self.code = code


class Core:
    """libkeras_ring_core.so through ctypes: init from a peer table, device collectives."""

    def __init__(self, path: str):
        from keras_ring.ops.loader import _declare_c_api

        self.c = ctypes.CDLL(path)
        _declare_c_api(self.c)
        vp, i64, i, d = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double
        tail = [vp, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]  # stream, name, err, len
        self.c.keras_ring_device_allreduce.argtypes = [vp, vp, i64, i, i, d, d, i] + tail
        self.c.keras_ring_device_allgather.argtypes = [vp, vp, i64, i64, i64, i, i] + tail
        self.c.keras_ring_device_broadcast.argtypes = [vp, vp, i64, i, i, i] + tail
        self.err = ctypes.create_string_buffer(4096)
        self.control_path = "not started"

    def _check(self, rc: int) -> None:
        if rc != 0:
            raise CollectiveError(rc, self.err.value.decode(errors="replace"))

    def init(self, rank: int, size: int, listener: socket.socket, ports: list[int], token: int,
             timeout: float = 60.0):
        from keras_ring.config import Config
        from keras_ring.ops.loader import NativeConfig

        # What a user's job on one host gets (shared memory between the ranks, the fast
        # agreement, ...), changed by the same KERAS_RING_* variables.
        user = Config.from_env()
        cfg = NativeConfig(
            rank=rank, size=size, listen_fd=listener.fileno(),
            hosts=(ctypes.c_char_p * size)(*[b"127.0.0.1"] * size),
            ports=(ctypes.c_int * size)(*ports), host_index=(ctypes.c_int * size)(*[0] * size),
            job_token=token, timeout_seconds=timeout, stall_warning_seconds=30.0,
            segment_bytes=user.segment_bytes, use_shm=int(user.use_shm),
            shm_channel_bytes=user.shm_channel_bytes, timeline=0,
            fast_agree=int(user.fast_agree), doubling_max_bytes=user.doubling_max_bytes,
            device_max_in_flight=user.device_max_in_flight)
        self._check(self.c.keras_ring_init(ctypes.byref(cfg), self.err, len(self.err)))
        self.control_path = control_path(cfg)

    def nccl_version(self, search_path: str) -> int:
        self.c.keras_ring_nccl_set_search_path(search_path.encode())
        version = ctypes.c_int(0)
        self._check(self.c.keras_ring_nccl_probe(search_path.encode(), ctypes.byref(version),
                                                 self.err, len(self.err)))
        return version.value

    def allreduce(self, x, y, name, op, device, stream=0, pre=1.0, post=1.0):
        self._check(self.c.keras_ring_device_allreduce(
            x.data.ptr, y.data.ptr, x.size, DTYPES[name], OPS[op], pre, post, device, stream,
            None, self.err, len(self.err)))

    def allgather(self, x, out, name, rows, row_elems, device, stream=0):
        self._check(self.c.keras_ring_device_allgather(
            x.data.ptr, out.data.ptr, rows, row_elems, out.shape[0], DTYPES[name], device,
            stream, None, self.err, len(self.err)))

    def broadcast(self, x, y, name, root, device, stream=0):
        self._check(self.c.keras_ring_device_broadcast(
            x.data.ptr, y.data.ptr, x.size, DTYPES[name], root, device, stream, None,
            self.err, len(self.err)))

    def barrier(self):
        # Process set 0, the global one (the argument came with process sets).
        self._check(self.c.keras_ring_barrier(0, b"gpu_check", self.err, len(self.err)))

    def shutdown(self):
        self.c.keras_ring_shutdown()


cases.load(Core, DTYPES, OPS)  # grouped allreduce, the backend's object counts
scatter.load(Core, DTYPES, OPS)  # reducescatter, alltoall
inflight.load(Core)  # allreduces with several outstanding


def rendezvous(listener: socket.socket, generation: int = 0) -> tuple[int, int, list[int], int, str]:
    """(rank, size, ports, job token, shared directory), through MPI or the spawn launcher;
    `generation` counts inits in one process (init after shutdown)."""
    port = listener.getsockname()[1]
    if "KR_CHECK_RANK" in os.environ:
        rank, size = int(os.environ["KR_CHECK_RANK"]), int(os.environ["KR_CHECK_SIZE"])
        shared = os.environ["KR_CHECK_DIR"]
        name = lambda r: Path(shared, f"port.{generation}.{r}")  # noqa: E731
        Path(shared, f"port.{generation}.{rank}.tmp").write_text(str(port))
        os.replace(Path(shared, f"port.{generation}.{rank}.tmp"), name(rank))
        deadline = time.time() + 120
        while not all(name(r).exists() for r in range(size)):
            if time.time() > deadline:
                raise SystemExit(f"rank {rank}: the other ranks did not start within 120 s")
            time.sleep(0.05)
        ports = [int(name(r).read_text()) for r in range(size)]
        return rank, size, ports, int(os.environ["KR_CHECK_TOKEN"]) + generation, shared
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise SystemExit(f"gpu_check: without --spawn the ranks meet through mpi4py: {e}")
    comm = MPI.COMM_WORLD
    shared = comm.bcast(tempfile.mkdtemp(prefix=f"kr_gpu_check{generation}_") if comm.rank == 0 else None)
    token = comm.bcast(secrets.randbits(63) if comm.rank == 0 else None)
    return comm.rank, comm.size, comm.allgather(port), token, shared


class Checks:
    def __init__(self, rank: int):
        self.rank, self.passed, self.failed = rank, 0, []

    def expect(self, what: str, ok: bool, detail: str = "") -> None:
        if ok:
            self.passed += 1
            return
        self.failed.append(what)
        print(f"[rank {self.rank}] FAIL {what} {detail}", flush=True)


def run_collective(checks: Checks, what: str, fn) -> bool:
    """Runs one collective; a fatal error ends the run (the runtime is broken afterwards)."""
    try:
        fn()
        return True
    except CollectiveError as e:
        checks.expect(what, False, str(e))
        if e.code in FATAL:
            raise
        return False


def check_one_allreduce(core: Core, cp, checks: Checks, rank: int, n: int, device: int,
                        name: str, op: str, count: int, pre: float = 1.0, post: float = 1.0,
                        in_place: bool = False) -> None:
    inputs = [rank_input(name, op, count, r) for r in range(n)]
    x = cp.asarray(inputs[rank])
    y = x if in_place else cp.empty_like(x)
    what = f"allreduce {op} {name} x{count}"
    if pre != 1.0 or post != 1.0:
        what += f" prescale={pre} postscale={post}"
    what += " in place" if in_place else ""
    run = lambda: core.allreduce(x, y, name, op, device, pre=pre, post=post)  # noqa: E731
    if not run_collective(checks, what, run):
        return
    want = reference_allreduce(name, op, inputs, pre, post)
    got = cp.asnumpy(y)
    if close(name, got, want):
        checks.expect(what, True)
        return
    # Read again after the whole device finished: tells a race on the caller's stream from
    # a wrong result.
    cp.cuda.Device().synchronize()
    checks.expect(what, False, mismatch(name, got, want) + "; after a device synchronize: "
                  + mismatch(name, cp.asnumpy(y), want))


def check_allreduce(core: Core, cp, checks: Checks, rank: int, n: int, device: int) -> None:
    for name in ("float32", "float16", "bfloat16", "float64", "int8", "uint8", "int32", "int64"):
        for op in OPS:
            if name == "bfloat16" and op == "Product":
                continue
            for count in (1, 3, 1000, (1 << 20) + 7):
                check_one_allreduce(core, cp, checks, rank, n, device, name, op, count)
    # Lengths of which NCCL's one-rank kernel leaves a tail (plan.h): at one rank these check
    # keras_ring's split, at more ranks they are just more lengths.
    for name, k in (("float32", 12), ("float16", 6), ("bfloat16", 6), ("float64", 6)):
        for count in one_rank.cut_counts(storage_dtype(name).itemsize, k):
            check_one_allreduce(core, cp, checks, rank, n, device, name, "Average", count)
    for (name, op, pre, post), count in itertools.product(
            (("float32", "Sum", 0.5, 3.0), ("float16", "Average", 0.25, 4.0),
             ("float64", "Average", 2.0, 1.5)), (4096, (1 << 20) + 7)):
        check_one_allreduce(core, cp, checks, rank, n, device, name, op, count, pre, post,
                            in_place=True)
    # Refused on every rank alike, and the runtime stays usable.
    x = cp.ones(8, cp.float32)
    try:
        core.allreduce(x, x, "float32", "Max", device, pre=2.0)
        checks.expect("Max with prescale is refused", False, "it ran")
    except CollectiveError as e:
        checks.expect("Max with prescale is refused", e.code == 3 and "not supported" in str(e), str(e))


def check_ordering(core: Core, cp, checks: Checks, rank: int, n: int, device: int) -> None:
    """The input is produced on a busy non-default stream and not synchronised: the
    collective must still read the finished values (it waits for an event on that stream)."""
    stream = cp.cuda.Stream(non_blocking=True)
    count = 1 << 22
    with stream:
        a = cp.ones((4096, 4096), cp.float32)
        for _ in range(8):
            a = a @ a / 4096.0  # keeps the stream busy for milliseconds; stays all ones
        x = cp.full(count, float(rank + 1), cp.float32) * a[0, 0]
        y = cp.empty_like(x)
    what = "allreduce after unsynchronised work on the caller's stream"
    if run_collective(checks, what, lambda: core.allreduce(x, y, "float32", "Sum", device, stream.ptr)):
        with stream:
            total = float(cp.asnumpy(y[::4096]).sum()) / (count // 4096)
        checks.expect(what, total == n * (n + 1) / 2, f"got mean {total}")
    stream.synchronize()


def check_allgather_broadcast(core: Core, cp, checks: Checks, rank: int, n: int, device: int) -> None:
    for name in ("float32", "float16", "int64", "uint8", "bool", "bfloat16"):
        for rows_of in (lambda r: 5, lambda r: 3 * r, lambda r: 1000 * (r + 1)):
            rows = [rows_of(r) for r in range(n)]
            inputs = [rank_input(name, "Sum", rows[r] * 4, r).reshape(rows[r], 4) for r in range(n)]
            out = cp.empty((sum(rows), 4), storage_dtype(name))
            what = f"allgather {name} rows {rows}"
            x = cp.asarray(inputs[rank])
            run = lambda: core.allgather(x, out, name, rows[rank], 4, device)  # noqa: E731
            if run_collective(checks, what, run):
                checks.expect(what, close(name, cp.asnumpy(out), np.concatenate(inputs)))
    for name in ("float32", "int32", "bool", "float64"):
        for count in (1, 1000, 1 << 20):
            for root in sorted({0, n - 1}):
                inputs = [rank_input(name, "Sum", count, r) for r in range(n)]
                x = cp.asarray(inputs[rank])
                y = cp.empty_like(x)
                what = f"broadcast {name} x{count} root {root}"
                if run_collective(checks, what, lambda: core.broadcast(x, y, name, root, device)):
                    checks.expect(what, close(name, cp.asnumpy(y), inputs[root]))


def timed(fn, iters: int, core: Core, sync) -> float:
    fn()
    fn()
    sync()
    core.barrier()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t) / iters


def benchmark(core: Core, cp, rank: int, n: int, device: int, shared: str,
              max_bytes: int) -> tuple[list, str | None]:
    rows = []
    buffers = {}
    for nbytes in bench_sizes(max_bytes):
        x = cp.ones(max(nbytes // 4, 1), cp.float32)
        y = cp.empty_like(x)
        buffers[nbytes] = (x, y)
        sec = timed(lambda: core.allreduce(x, y, "float32", "Sum", device), iterations(nbytes), core,
                    cp.cuda.runtime.deviceSynchronize)
        algbw, busbw = bandwidths(nbytes, sec, n)
        rows.append({"bytes": nbytes, "kr_us": sec * 1e6, "kr_algbw": algbw, "kr_busbw": busbw})
    label = None
    try:  # after keras_ring, so torch finds the NCCL keras_ring loaded if they share the soname
        import torch
        import torch.distributed as dist

        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=f"file://{shared}/torch_store", rank=rank,
                                world_size=n)
        v = torch.cuda.nccl.version()  # what torch was built against, not what it runs
        v = ".".join(map(str, v)) if isinstance(v, tuple) else v
        label = f"torch {torch.__version__.split('+')[0]} nccl {v}"
        with open("/proc/self/maps") as maps:
            if len(cases.mapped_libraries(maps.read())["libnccl"]) == 1:
                # One libnccl mapped: torch runs the NCCL keras_ring loaded (same soname).
                label = f"torch {torch.__version__.split('+')[0]} on that NCCL"
        for row in rows:
            x, _ = buffers[row["bytes"]]
            t = torch.as_tensor(x, device=f"cuda:{device}")  # the same memory, no copy
            sec = timed(lambda: dist.all_reduce(t), iterations(row["bytes"]), core,
                        torch.cuda.synchronize)
            row["torch_us"] = sec * 1e6
            row["torch_algbw"], row["torch_busbw"] = bandwidths(row["bytes"], sec, n)
        dist.destroy_process_group()
    except Exception as e:  # the keras_ring results stand on their own
        if rank == 0:
            print(f"torch.distributed comparison skipped: {type(e).__name__}: {e}", flush=True)
        label = None
    return rows, label


def share_gpu_setup(gpus: int, n: int, nccl_code: int) -> str | None:
    """Prepares ranks to share GPUs (NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1, and few
    CTAs each, so the ranks' kernels fit on the GPU side by side); the reason when they
    cannot share, else None."""
    if gpus >= n:
        return None
    if nccl_code < 23000:
        return (f"{n} ranks would share {gpus} GPU(s), which needs NCCL >= 2.30 "
                f"(found {nccl_version_string(nccl_code)}); not running fewer ranks instead")
    os.environ.setdefault("NCCL_MULTI_RANK_GPU_ENABLE", "1")
    os.environ.setdefault("NCCL_MAX_CTAS", "16")
    # Without MPS the ranks' kernels take turns on the GPU, so a collective may wait a time
    # slice for its peer's: a tenth of the calls keeps the run within its time limit.
    global ITERATION_CAP
    ITERATION_CAP = 20
    cases.STABLE_ITERATIONS = 1_000
    inflight.ALLREDUCES = 200
    return None


def run_checks(core, cp, checks: Checks, rank: int, n: int, device: int) -> dict:
    """Every check, phase by phase. A phase that fails outside a collective (CuPy missing a
    library, a bug here) is recorded and the next one runs: one GPU run must report as much
    as it can. A fatal collective error still ends the run (the runtime is broken)."""
    this = sys.modules[__name__]
    extra: dict = {}
    phases = (
        ("first collective", lambda: extra.update(cases.check_first_latency(core, cp, rank, device))),
        ("allreduce", lambda: check_allreduce(core, cp, checks, rank, n, device)),
        ("ordering", lambda: check_ordering(core, cp, checks, rank, n, device)),
        ("allgather, broadcast", lambda: check_allgather_broadcast(core, cp, checks, rank, n, device)),
        ("reducescatter", lambda: scatter.check_reducescatter(this, core, cp, checks, rank, n, device)),
        ("alltoall", lambda: scatter.check_alltoall(this, core, cp, checks, rank, n, device)),
        ("grouped", lambda: cases.check_grouped(this, core, cp, checks, rank, n, device)),
        ("edge cases", lambda: cases.check_edge_cases(this, core, cp, checks, rank, n, device)),
        ("many small", lambda: extra.update(cases.check_many_small(this, core, cp, checks, rank, n, device))),
        ("process", lambda: extra.update(cases.check_process(checks, cp, rank, device))),
        ("in flight", lambda: extra.update(inflight.check_in_flight(this, core, cp, checks, rank, n, device))),
    )
    for label, phase in phases:  # the first one makes the communicator
        if rank == 0:
            print(f"# {time.strftime('%H:%M:%S')} {label} ...", flush=True)
        try:
            phase()
        except CollectiveError:
            raise
        except Exception as e:  # noqa: BLE001 - reported as a failed check, the run goes on
            checks.expect(f"{label}: the phase ran ({type(e).__name__}: {e})", False)
    return extra


def write_results(path: str | None, **results) -> None:
    if path:
        Path(path).write_text(json.dumps(results, indent=1))


def run_rank(args) -> int:
    try:
        import cupy as cp
    except ImportError as e:
        print(f"gpu_check: CuPy is needed ({e})", flush=True)
        return 2
    gpus = cp.cuda.runtime.getDeviceCount()
    core = Core(args.lib)
    from keras_ring.gpu import library_search_path

    preferred = os.environ.get("KERAS_RING_GPU_CHECK_NCCL_DIR", "")  # gpu_check.sh's newest find
    search = ":".join(p for p in (preferred, library_search_path(), *cuda_runtime_dirs())
                      if p and p != "-")
    version = core.nccl_version(search)  # before init: NCCL reads its settings when it starts

    def connect(generation: int, timeout: float = 60.0) -> Core:  # a scenario's inits
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        rank, size, ports, token, _ = rendezvous(listener, generation + 1)
        core.init(rank, size, listener, ports, token, timeout)
        listener.close()
        return core

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    rank, n, ports, token, shared = rendezvous(listener)
    if args.ranks and n != args.ranks:
        print(f"gpu_check: started as {n} rank(s), expected {args.ranks}: mpi4py's MPI does not "
              "match this mpirun", flush=True)
        return 3
    cannot_share = share_gpu_setup(gpus, n, version)
    if cannot_share:
        print(f"gpu_check: {cannot_share}", flush=True)
        return 2
    device = rank % gpus
    cp.cuda.Device(device).use()
    if args.scenario:
        listener.close()
        faults.report(shared, args.scenario,
                      rank, faults.run_scenario(sys.modules[__name__], cp, args.scenario, rank, n,
                                                device, connect))
        return 0
    core.init(rank, n, listener, ports, token)
    checks = Checks(rank)
    try:
        if rank == 0:
            gpu_name = cp.cuda.runtime.getDeviceProperties(device)["name"].decode()
            print(f"# {n} ranks on {gpus} GPU(s) ({gpu_name}), NCCL {nccl_version_string(version)}, "
                  f"CuPy {cp.__version__}, NCCL_MAX_CTAS={os.environ.get('NCCL_MAX_CTAS', '-')}",
                  flush=True)
            print(f"# control path between the ranks: {core.control_path}", flush=True)
            if n == 1:
                print("# one rank: the checks' uneven, non-uniform and peer paths move nothing "
                      "here, so their passes say little; the table's busbw is 0", flush=True)
        started = time.perf_counter()
        extra = run_checks(core, cp, checks, rank, n, device)
        summary = {"ranks": n, "gpus": gpus, "nccl": nccl_version_string(version),
                   "control": core.control_path, "failed": checks.failed, "passed": checks.passed,
                   **extra}
        if rank == 0:
            print(f"# checks: {checks.passed} passed, {len(checks.failed)} failed "
                  f"({time.perf_counter() - started:.1f} s)", flush=True)
            write_results(args.json, **summary, rows=[], torch=None)  # kept if the table hangs
            print(f"# {time.strftime('%H:%M:%S')} benchmark ...", flush=True)
        rows, label = benchmark(core, cp, rank, n, device, shared, args.max_bytes)
    except CollectiveError as e:
        print(f"[rank {rank}] stopped: {e}", flush=True)
        return 1
    finally:
        core.shutdown()
    if rank == 0:
        print(table(rows, n, label), flush=True)
        write_results(args.json, **summary, rows=rows, torch=label)
    return 1 if checks.failed else 0


def spawn(args, scenario: str | None = None) -> list[int] | None:
    """Starts args.spawn ranks of this script without MPI; their exit statuses (None when
    they ran past the timeout and were stopped). A scenario job runs one failure path."""
    shared = tempfile.mkdtemp(prefix="kr_gpu_check_")
    env = dict(os.environ, KR_CHECK_SIZE=str(args.spawn), KR_CHECK_DIR=shared,
               KR_CHECK_TOKEN=str(secrets.randbits(62)))
    argv = [sys.executable, __file__, "--lib", args.lib, "--max-bytes", str(args.max_bytes)]
    argv += ["--json", args.json] if args.json and not scenario else []
    argv += ["--scenario", scenario] if scenario else []
    procs = [subprocess.Popen(argv, env=dict(env, KR_CHECK_RANK=str(r))) for r in range(args.spawn)]
    deadline = time.time() + args.timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1, deadline - time.time())))
        except subprocess.TimeoutExpired:
            print(f"gpu_check: a rank ran past {args.timeout} s; stopping all", flush=True)
            for q in procs:
                q.kill()
            return None
    if scenario:
        args.shared = shared
    return codes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lib", help="libkeras_ring_core.so built by gpu_check.sh")
    parser.add_argument("--find-nccl", action="store_true",
                        help="print 'GPUS DIR VERSION_CODE' for the newest libnccl.so.2 here")
    parser.add_argument("--ranks", type=int, default=0, help="under mpirun: the expected world size")
    parser.add_argument("--spawn", type=int, default=0, help="start this many ranks without MPI")
    parser.add_argument("--faults", type=int, default=0,
                        help="run the failure scenarios, each on this many ranks")
    parser.add_argument("--scenario", choices=faults.SCENARIOS, help=argparse.SUPPRESS)
    parser.add_argument("--max-bytes", type=int, default=1 << 28)
    parser.add_argument("--json", default=None, help="rank 0 writes the results here")
    parser.add_argument("--timeout", type=float, default=480.0)
    args = parser.parse_args(argv)
    if args.find_nccl:
        try:
            import cupy

            gpus = cupy.cuda.runtime.getDeviceCount()
        except Exception:  # reported by the run itself
            gpus = 0
        directory, code = find_nccl()
        print(gpus, directory or "-", code)
        return 0
    if not args.lib:
        parser.error("--lib is required")
    if args.faults:
        args.spawn = args.faults
        return faults.run_all(args, spawn)
    if args.spawn:
        codes = spawn(args)
        return 124 if codes is None else max(codes, key=abs)
    return run_rank(args)


if __name__ == "__main__":
    sys.exit(main())
