"""``KERAS_RING_TIMELINE=path.json``: a Chrome trace (open it in Perfetto or chrome://tracing).

One row per rank; per collective its phases — queued (submitted by the kernel, waiting for the
worker), waiting for peers (the signature exchange: until every rank has submitted it),
transfer/reduce (the data moving) — and an instant "done" event, with byte counts. At
``shutdown()`` every rank sends its events to rank 0, which writes the file; if that is
impossible (a peer died) each rank writes ``path.rank<N>.json`` instead. ``init()`` checks that
the file can be written; where it no longer can at shutdown (the directory removed, the disk
full), the trace goes to the temp directory, with a warning naming the file.

``mark(tensor, label)`` puts a point of the program on the same clock (an instant event named
``label`` when ``tensor`` is computed: a gradient, say, to see which collectives overlap
backprop), and ``record(True)`` / ``recorded()`` record and read this rank's timeline without
the file, from inside a program.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import tensorflow as tf

from keras_ring.objects import allgather_object
from keras_ring.ops.loader import Library, library
from keras_ring.peer_table import Topology
from keras_ring.runtime import RUNTIME

@tf.RegisterGradient("KerasRingTimelineMark")
def _mark_gradient(op, grad):  # a mark is the identity
    return grad


_PHASES = (("queued", 3, 4), ("waiting for peers", 4, 5), ("transfer/reduce", 5, 6))


def read_events(lib: Library) -> list[list[str]]:
    """Drains the runtime's recorded events (tab-separated lines) as field lists."""
    chunks = []
    buf = ctypes.create_string_buffer(1 << 16)
    while n := lib.c.keras_ring_timeline_read(buf, len(buf)):
        chunks.append(buf.raw[:n])
    text = b"".join(chunks).decode(errors="replace")
    return [line.split("\t") for line in text.splitlines() if line]


def mark(tensor: Any, label: str) -> tf.Tensor:
    """Returns ``tensor`` unchanged; when it is computed, a recording timeline gets a mark.

    The mark is an instant event named ``label`` on this rank's row, on the collectives'
    clock. The op is not stateful (a stateful one would be ordered with the collectives and
    delay them), so it runs as soon as ``tensor`` exists, and only if its result is used.
    It runs on the CPU.
    """
    if not isinstance(label, str) or not label:
        raise ValueError(f"keras_ring.timeline.mark: label must be a non-empty str, got {label!r}")
    return library().ops.keras_ring_timeline_mark(tensor, label=label)


def record(on: bool = True) -> None:
    """Starts (or with False stops) recording this rank's timeline, as KERAS_RING_TIMELINE does."""
    RUNTIME.library("keras_ring.timeline.record").c.keras_ring_timeline_record(int(bool(on)))


def recorded() -> list[dict[str, Any]]:
    """This rank's events recorded since the last read (and forgets them), oldest first.

    Each is a dict: ``label`` (e.g. ``"grouped_allreduce 'gradients.bucket0'"``, or a mark's
    label), ``mark`` (True for a mark), ``seq`` (0 for a mark), ``bytes``, and microsecond times
    ``submitted``, ``started``, ``exchanged``, ``done`` (all equal for a mark), ``ok``. The times
    are this host's monotonic clock, for comparing events of one rank; the trace file
    (``KERAS_RING_TIMELINE``) puts them on the wall clock, to compare across hosts.
    """
    out = []
    for seq, label, nbytes, submitted, started, exchanged, done, ok, _ in read_events(
            RUNTIME.library("keras_ring.timeline.recorded")):
        out.append({"label": label, "mark": seq == "0", "seq": int(seq), "bytes": int(nbytes),
                    "submitted": int(submitted), "started": int(started),
                    "exchanged": int(exchanged), "done": int(done), "ok": ok == "1"})
    return out


def trace_events(rank: int, events: list[list[str]], shift: int = 0) -> list[dict[str, Any]]:
    """Chrome trace events of one rank: a named row (tid) per rank in one process; ``shift``
    microseconds added to every time (see ``wall_clock_shift``)."""
    out: list[dict[str, Any]] = [
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}},
        {"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": rank, "args": {"sort_index": rank}},
    ]
    for seq, label, nbytes, *times, ok, inlined in events:
        times = [str(int(x) + shift) for x in times]
        t = [int(x) for x in times]  # submitted, started, exchanged, done (microseconds)
        if seq == "0":  # a mark
            out.append({"ph": "i", "s": "t", "name": label, "cat": "mark", "pid": 0, "tid": rank,
                        "ts": t[0], "args": {"mark": label}})
            continue
        fields = [seq, label, nbytes, *times]
        args = {"collective": label, "seq": int(seq), "bytes": int(nbytes),
                "ok": ok == "1", "completed_in_exchange": inlined == "1"}
        for name, start, end in _PHASES:
            begin, finish = int(fields[start]), int(fields[end])
            out.append({"ph": "X", "name": name, "cat": label.split(" ")[0], "pid": 0, "tid": rank,
                        "ts": begin, "dur": max(finish - begin, 0), "args": args})
        out.append({"ph": "i", "s": "t", "name": "done" if ok == "1" else "failed", "pid": 0,
                    "tid": rank, "ts": t[3], "args": args})
    return out


def wall_clock_shift() -> int:
    """Microseconds from this host's monotonic clock (the runtime's, counted from its boot) to
    the wall clock, which NTP keeps alike across hosts: every host boots at its own time, so
    raw times put one collective hours apart on two hosts' rows."""
    pairs = []
    for _ in range(3):  # the closest pair of readings
        before = time.monotonic_ns()
        wall = time.time_ns()
        after = time.monotonic_ns()
        pairs.append((after - before, wall - (before + after) // 2))
    return min(pairs)[1] // 1000


def write(path: str, topology: Topology, lib: Library) -> None:
    """Gathers every rank's events on rank 0 and writes the trace (called by shutdown), its
    times on the wall clock."""
    events = trace_events(topology.rank, read_events(lib), wall_clock_shift())
    if topology.size > 1:
        try:
            gathered = allgather_object(events)
        except Exception:  # a peer is gone: keep what this rank has
            _save(Path(f"{os.path.splitext(path)[0]}.rank{topology.rank}.json"), events)
            return
        events = [e for rank_events in gathered for e in rank_events]
    if topology.rank == 0:
        _save(Path(path), events)


def _save(path: Path, events: list[dict[str, Any]]) -> None:
    """Writes the trace to ``path``, else to a new file in the temp directory: init() found
    ``path`` writable, so failing now (directory removed, disk full) must not lose the run's
    trace, which exists nowhere else once read from the runtime."""
    try:
        _dump(path, events)
        return
    except OSError as e:
        first = e
    fallback = None
    try:
        fd, fallback = tempfile.mkstemp(prefix=f"{path.stem}.", suffix=path.suffix or ".json")
        os.close(fd)
        _dump(Path(fallback), events)
    except OSError as e:
        if fallback is not None:
            with contextlib.suppress(OSError):  # an empty file is no trace either
                os.unlink(fallback)
        raise OSError(f"KERAS_RING_TIMELINE: the trace could not be written to {str(path)!r} "
                      f"({first.strerror or first}) nor to the temp directory "
                      f"({e.strerror or e}); it is lost") from first
    warnings.warn(f"keras_ring: KERAS_RING_TIMELINE: the trace could not be written to "
                  f"{str(path)!r} ({first.strerror or first}); it was written to "
                  f"{fallback!r} instead", RuntimeWarning, stacklevel=2)


def _dump(path: Path, events: list[dict[str, Any]]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):  # a partial file (disk full) is no trace
            tmp.unlink()
        raise
