"""What the nccl-tests-style tables of `make bench` share: how a collective is timed, the
memcpy yardstick, and the table layout (so that every table reads and parses alike).

A column is (name, kind): "bw" prints time, algbw and busbw; "time" prints a time only;
"ratio" prints a plain number (e.g. one time over another).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from mpi4py import MPI


def memcpy_bandwidth(nbytes: int = 64 << 20) -> float:
    """Single-core copy bandwidth in GB/s (best of several), measured on this rank."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(8):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


class _Run:
    """What the command line chose for the whole run."""

    quick = False  # --quick: one short batch per cell (checks a table's shape, measures nothing)


def quick() -> bool:
    return _Run.quick


def timed(fn, nbytes: int, comm) -> float:
    """Median seconds per call: warm-up, then repeated batches, ranks started together."""
    fn()
    fn()
    iters = 2 if _Run.quick else max(3, min(200, int(0.05 / max(nbytes / 2e9, 2e-5))))
    samples = []
    for _ in range(1 if _Run.quick else 5):
        comm.Barrier()
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter() - t) / iters)
    # The slowest rank defines the collective's time.
    return comm.allreduce(float(np.median(samples)), op=MPI.MAX)


def header(columns: list[tuple[str, str]]) -> str:
    """The two header lines of a table whose first column is bytes per rank."""
    names = "".join(f" | {name:^27}" if kind == "bw" else f" | {name:>14}"
                    for name, kind in columns)
    units = "".join(" | {:>9} {:>8} {:>8}".format("time(us)", "algbw", "busbw") if kind == "bw"
                    else " | {:>14}".format("time(us)" if kind == "time" else "ratio")
                    for _, kind in columns)
    return f"{'bytes':>11}{names}\n{'':>11}{units}"


def bw_cell(seconds: float, nbytes: int, bus_factor: float) -> str:
    """Time, algbw (nbytes / time) and busbw (algbw * bus_factor), in us and GB/s."""
    algbw = nbytes / seconds / 1e9
    return f" | {seconds * 1e6:9.1f} {algbw:8.2f} {algbw * bus_factor:8.2f}"


def time_cell(seconds: float) -> str:
    return f" | {seconds * 1e6:14.1f}"


def ratio_cell(value: float) -> str:
    return f" | {value:14.2f}"


def preamble(comm, what: str) -> None:
    """The lines above a run's tables (printed by rank 0): world, cores, memcpy yardstick."""
    copy_bw = memcpy_bandwidth() if comm.rank == 0 else 0.0
    comm.Barrier()
    if comm.rank == 0:
        print(f"# {comm.size} ranks, {os.cpu_count()} cores; {what}; times are medians, "
              "the slowest rank's")
        print(f"# single-core memcpy of 64 MiB: {copy_bw:.2f} GB/s")


def _parse_args(default_max: int) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--min-bytes", type=int, default=4096)
    parser.add_argument("--max-bytes", type=int, default=default_max)
    parser.add_argument("--only", default="",
                        help="comma-separated column names to time (default: all)")
    parser.add_argument("--quick", action="store_true",
                        help="time each cell briefly: the tables' shape, no usable numbers")
    args = parser.parse_args()
    _Run.quick = args.quick
    return args


def size_range(default_max: int) -> tuple[int, int]:
    """--min-bytes and --max-bytes from the command line (bytes per rank)."""
    args = _parse_args(default_max)
    return args.min_bytes, args.max_bytes


def only_columns(default_max: int) -> list[str]:
    """--only: the columns to time (empty: all), for quick side-by-side runs."""
    return [c.strip() for c in _parse_args(default_max).only.split(",") if c.strip()]


def sizes(min_bytes: int, max_bytes: int):
    """Bytes per rank: min_bytes, then x4 up to max_bytes."""
    nbytes = min_bytes
    while nbytes <= max_bytes:
        yield nbytes
        nbytes *= 4
