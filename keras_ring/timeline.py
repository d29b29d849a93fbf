"""``KERAS_RING_TIMELINE=path.json``: a Chrome trace (open it in Perfetto or chrome://tracing).

One row per rank; per collective its phases — queued (submitted by the kernel, waiting for the
worker), waiting for peers (the signature exchange: until every rank has submitted it),
transfer/reduce (the data moving) — and an instant "done" event, with byte counts. The runtime
holds up to ``KERAS_RING_TIMELINE_MEMORY_EVENTS`` events and appends older ones to an unnamed
file in the temp directory, so a long run's trace does not grow the process. At ``shutdown()``
every rank sends its events to rank 0 in bounded pieces, and rank 0 writes the file; if that is
impossible (a peer died) each rank writes ``path.rank<N>.json`` instead. Each world of an
elastic job, and each later ``init()`` of a process, writes a trace of its own
(``path.world<N>.json``, :func:`trace_path`): none overwrites an earlier one. ``init()``
checks that the file can be written; where it no longer can at shutdown (the directory
removed, the disk full), the trace goes to the temp directory, with a warning naming the file.

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
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import tensorflow as tf

from keras_ring.ops.loader import Library, library
from keras_ring.peer_table import Topology
from keras_ring.runtime import RUNTIME

@tf.RegisterGradient("KerasRingTimelineMark")
def _mark_gradient(op, grad):  # a mark is the identity
    return grad


# Each phase from one recorded time to the next (submitted, started, exchanged, done).
_PHASES = (("queued", 0, 1), ("waiting for peers", 1, 2), ("transfer/reduce", 2, 3))


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
    (``KERAS_RING_TIMELINE``) puts them on the wall clock, to compare across hosts. With that
    file on, events past ``KERAS_RING_TIMELINE_MEMORY_EVENTS`` unread ones went to it instead.
    """
    out = []
    for seq, label, nbytes, submitted, started, exchanged, done, ok, _ in read_events(
            RUNTIME.library("keras_ring.timeline.recorded")):
        out.append({"label": label, "mark": seq == "0", "seq": int(seq), "bytes": int(nbytes),
                    "submitted": int(submitted), "started": int(started),
                    "exchanged": int(exchanged), "done": int(done), "ok": ok == "1"})
    return out


def _row(rank: int) -> list[dict[str, Any]]:
    return [
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}},
        {"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": rank, "args": {"sort_index": rank}},
    ]


def _event(rank: int, fields: list[str]) -> list[dict[str, Any]]:
    """The trace events of one recorded event (its phases and "done", or a mark)."""
    seq, label, nbytes, *times, ok, inlined = fields
    t = [int(x) for x in times]  # submitted, started, exchanged, done (microseconds)
    if seq == "0":  # a mark
        return [{"ph": "i", "s": "t", "name": label, "cat": "mark", "pid": 0, "tid": rank,
                 "ts": t[0], "args": {"mark": label}}]
    args = {"collective": label, "seq": int(seq), "bytes": int(nbytes),
            "ok": ok == "1", "completed_in_exchange": inlined == "1"}
    out = []
    for name, start, end in _PHASES:
        begin, finish = t[start], t[end]
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


class SpillFile:
    """Where the runtime puts this rank's recorded events beyond the ones it holds.

    Under ``KERAS_RING_TIMELINE`` from ``init()`` to ``shutdown()``: an unnamed file in the temp
    directory (it goes with the process, however that ends), which the runtime appends
    Drain's lines to once ``KERAS_RING_TIMELINE_MEMORY_EVENTS`` events are held.
    """

    def __init__(self) -> None:
        self._file: IO[bytes] | None = None

    def start(self, lib: Library, max_events: int) -> None:
        """Starts spilling, once per runtime: init() on a running one changes nothing."""
        if self._file is not None:
            return
        try:
            self._file = tempfile.TemporaryFile(prefix="keras_ring_timeline.")
        except OSError as e:
            warnings.warn(f"keras_ring: KERAS_RING_TIMELINE: no file for the events in the temp "
                          f"directory ({e.strerror or e}); this rank holds them all in memory "
                          "until shutdown()", RuntimeWarning, stacklevel=2)
            return
        lib.c.keras_ring_timeline_spill(self._file.fileno(), max_events)

    @property
    def bytes(self) -> int:
        """How much the runtime has written to the file so far."""
        return os.fstat(self._file.fileno()).st_size if self._file is not None else 0

    def stop(self, lib: Library) -> IO[bytes] | None:
        """Stops the spilling (after a write in progress) and returns the file, read from its
        start, or None; the caller closes it."""
        spilled, self._file = self._file, None
        if spilled is None:
            return None
        error = lib.c.keras_ring_timeline_spill(-1, 1)
        if error > 0:
            warnings.warn(f"keras_ring: KERAS_RING_TIMELINE: writing events to the temp directory "
                          f"failed ({os.strerror(error)}); this rank held the later ones in "
                          "memory", RuntimeWarning, stacklevel=2)
        spilled.seek(0)
        return spilled


SPILL = SpillFile()
_WRITTEN: set[str] = set()  # the trace paths this process has written


def trace_path(path: str) -> str:
    """Where this runtime's trace goes: ``path``, or ``<path less .json>.world<N>.json``
    where an earlier world's trace would be overwritten: in an elastic job every world's
    (``N`` its number, the same on every worker; a newcomer may be rank 0), and a later
    ``init()``'s in this process (``N`` counts this process's ``init()``s, the same on every
    rank, which start their runtimes together)."""
    if RUNTIME.elastic is not None:
        world: int | None = RUNTIME.elastic.generation
    else:
        world = RUNTIME.generation if os.path.abspath(path) in _WRITTEN else None
    if world is None:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}.world{world}{ext or '.json'}"


class _RankEvents:
    """This rank's recorded events at shutdown, the spilled ones first, as field lists with
    their times on the wall clock; iterable more than once (a failed gathering writes them
    again, alone)."""

    def __init__(self, spilled: IO[bytes] | None, held: list[list[str]]) -> None:
        self._spilled, self._held = spilled, held
        self._shift = wall_clock_shift()

    def __iter__(self) -> Iterator[list[str]]:
        if self._spilled is not None:
            self._spilled.seek(0)
            for line in self._spilled:
                fields = line.decode(errors="replace").rstrip("\n").split("\t")
                if len(fields) == 9:  # a line cut short by a failed write is skipped
                    yield self._shifted(fields)
        for fields in self._held:
            yield self._shifted(fields)

    def _shifted(self, fields: list[str]) -> list[str]:
        return fields[:3] + [str(int(x) + self._shift) for x in fields[3:7]] + fields[7:]


def write(path: str, topology: Topology, lib: Library, gather: bool = True) -> None:
    """Gathers every rank's events on rank 0 and writes the trace (called by shutdown), its
    times on the wall clock. Without ``gather`` (the program leaves with an error, and its
    peers may wait in one of its collectives) each rank writes its own, as where a peer is
    gone."""
    _WRITTEN.add(os.path.abspath(path))
    spilled = SPILL.stop(lib)
    try:
        events = _RankEvents(spilled, read_events(lib))
        rank = topology.rank
        if topology.size == 1:
            _save(Path(path), lambda: _trace(((0, e) for e in events), [0]))
            return
        if gather:
            try:
                gathered = _gather_on_root(events, topology, Path(path).parent)
            except Exception as e:  # a peer is gone, say: keep what this rank has
                warnings.warn(f"keras_ring: KERAS_RING_TIMELINE: the ranks' events could not "
                              f"be gathered ({type(e).__name__}: {e}); each rank writes its "
                              "own", RuntimeWarning, stacklevel=2)
            else:
                if gathered is not None:  # rank 0
                    with gathered:
                        _save(Path(path),
                              lambda: _trace(_received(gathered), range(topology.size)))
                return
        _save(Path(f"{os.path.splitext(path)[0]}.rank{rank}.json"),
              lambda: _trace(((rank, e) for e in events), [rank]))
    finally:
        if spilled is not None:
            spilled.close()


# Bytes each rank sends to rank 0 per round at shutdown: every round's pieces are in rank 0's
# memory at once.
_ROUND_BYTES = 8 << 20


def _gather_on_root(events: _RankEvents, topology: Topology, beside: Path
                    ) -> IO[bytes] | None:
    """Sends this rank's events to rank 0 in rounds of bounded size; rank 0 returns a file of
    every rank's lines, each led by its rank (read from its start), the others None. Rank 0's
    file is in the temp directory, else in ``beside`` (the trace's, which init() checked)."""
    import numpy as np

    from keras_ring import collectives
    from keras_ring.ops import wrappers  # scatter.alltoall sits in a layer above this one

    piece = max(_ROUND_BYTES // topology.size, 64 << 10)
    lines = iter(events)
    received = None
    if topology.rank == 0:
        try:
            received = tempfile.TemporaryFile(prefix="keras_ring_timeline.")
        except OSError:
            received = tempfile.TemporaryFile(prefix=".keras_ring_timeline.", dir=beside)
    try:
        more = True
        while True:
            chunk, more = _next_piece(lines, piece) if more else (b"", False)
            splits = [len(chunk)] + [0] * (topology.size - 1)
            data, counts = collectives._run(
                wrappers.alltoall, tf.constant(np.frombuffer(chunk, np.uint8)),
                tf.constant(splits, tf.int32), "keras_ring.timeline", 0)
            if received is not None:
                _append_received(received, data.numpy().tobytes(), counts.numpy())
            if not int(collectives.allreduce(np.int32(more), op=collectives.Max,
                                             name="keras_ring.timeline.more")):
                break
    except BaseException:
        if received is not None:
            received.close()
        raise
    if received is not None:
        received.seek(0)
    return received


def _next_piece(lines: Iterator[list[str]], limit: int) -> tuple[bytes, bool]:
    """Up to about ``limit`` bytes of lines (at least one), and whether lines are left."""
    out, size = [], 0
    for fields in lines:
        line = ("\t".join(fields) + "\n").encode()
        out.append(line)
        size += len(line)
        if size >= limit:
            return b"".join(out), True
    return b"".join(out), False


def _append_received(received: IO[bytes], data: bytes, counts: Any) -> None:
    start = 0
    for rank, count in enumerate(counts):
        for line in data[start:start + int(count)].splitlines():
            received.write(b"%d\t%s\n" % (rank, line))
        start += int(count)


def _received(received: IO[bytes]) -> Iterator[tuple[int, list[str]]]:
    received.seek(0)
    for line in received:
        rank, *fields = line.decode(errors="replace").rstrip("\n").split("\t")
        yield int(rank), fields


def _trace(events: Iterable[tuple[int, list[str]]], ranks: Iterable[int]
           ) -> Iterator[dict[str, Any]]:
    """The trace's events: each rank's row, then every (rank, fields) event's."""
    for rank in ranks:
        yield from _row(rank)
    for rank, fields in events:
        yield from _event(rank, fields)


def _save(path: Path, events: Callable[[], Iterable[dict[str, Any]]]) -> None:
    """Writes the trace of ``events()`` to ``path``, else to a new file in the temp directory:
    init() found ``path`` writable, so failing now (directory removed, disk full) must not lose
    the run's trace, which exists nowhere else once read from the runtime."""
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


def _dump(path: Path, events: Callable[[], Iterable[dict[str, Any]]]) -> None:
    """Writes the trace event by event: a long run's would not fit in memory as one text."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as out:
            out.write('{"displayTimeUnit": "ms", "traceEvents": [\n')
            separator = ""
            for event in events():
                out.write(separator + json.dumps(event))
                separator = ",\n"
            out.write("\n]}\n")
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):  # a partial file (disk full) is no trace
            tmp.unlink()
        raise
