"""The bucket size chosen from a short measurement at the start of training (``"auto"``).

Horovod's autotuner searches fusion settings while training runs; this is simpler and
deterministic. Before the first reduction every rank times an allreduce of a small and of a
large buffer (the best of a few calls each) and fits ``time = fixed + bytes * per_byte``. A
bucket should be big enough that its fixed cost (signature exchange, dispatch, the ring's
latency) is at most a tenth of its time, and otherwise as small as possible, so that the
first buckets can run while backprop continues: ``bytes >= 9 * fixed / per_byte``, rounded
up to a power of two between ``MIN_BYTES`` and ``MAX_BYTES``.

All ranks must plan the same buckets or their collectives would not match: the timings are
allreduced (Max: the slowest rank's) before the rule runs, so every rank applies the same
rule to the same numbers and chooses the same size.
"""

from __future__ import annotations

import math
import threading
import time

import tensorflow as tf

from keras_ring.collectives import Max, Sum, allreduce
from keras_ring.process_sets import ProcessSet

MIN_BYTES = 1 << 20
MAX_BYTES = 64 << 20
FALLBACK_BYTES = 32 << 20  # when the timings make no sense (noise made the large one faster)
PROBE_BYTES = (64 << 10, 4 << 20)
REPEATS = 5


def choose(fixed_seconds: float, seconds_per_byte: float) -> int:
    """The rule: the smallest power of two whose fixed cost is at most a tenth of its time."""
    if not (seconds_per_byte > 0 and math.isfinite(fixed_seconds) and math.isfinite(seconds_per_byte)):
        return FALLBACK_BYTES
    want = 9.0 * max(fixed_seconds, 0.0) / seconds_per_byte
    size = MIN_BYTES
    while size < want and size < MAX_BYTES:
        size *= 2
    return size


def fit(timings: list[float]) -> tuple[float, float]:
    """(fixed seconds, seconds per byte) through the two probes' times."""
    (small, large), (t_small, t_large) = PROBE_BYTES, timings
    per_byte = (t_large - t_small) / (large - small)
    return t_small - small * per_byte, per_byte


def _probe(nbytes: int, process_set: ProcessSet) -> float:
    x = tf.zeros([nbytes // 4], tf.float32)
    allreduce(x, op=Sum, name=f"bucket_tuning.{nbytes}", process_set=process_set)  # warm-up
    best = math.inf
    for _ in range(REPEATS):
        start = time.perf_counter()
        allreduce(x, op=Sum, name=f"bucket_tuning.{nbytes}", process_set=process_set)
        best = min(best, time.perf_counter() - start)
    return best


class Measured:
    """The sizes measured in this job, one per process set: each measures once, on first use.

    Kept for the job, not per optimizer: a ``DistributedGradientTape`` made anew every step
    measures only once. ``shutdown()`` forgets them (a new job may run on other machines).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chosen: dict[int, int] = {}
        self.timings: dict[int, list[float]] = {}  # agreed (slowest rank's) probe times

    def bucket_bytes(self, process_set: ProcessSet) -> int:
        """The chosen size; the first call measures (a collective: every rank must call it)."""
        set_id = process_set.process_set_id
        with self._lock:
            if set_id not in self._chosen:
                self._chosen[set_id] = self._measure(process_set)
            return self._chosen[set_id]

    def _measure(self, process_set: ProcessSet) -> int:
        if process_set.size() == 1:
            return FALLBACK_BYTES  # nothing travels: nothing to measure
        # Runs eagerly even while a tf.function traces the training step: at the first
        # trace, which every rank reaches before any of that step's collectives.
        with tf.init_scope():
            local = [_probe(n, process_set) for n in PROBE_BYTES]
            agreed = allreduce(tf.constant(local, tf.float64), op=Max,
                               name="bucket_tuning.timings", process_set=process_set)
        timings = [float(t) for t in agreed.numpy()]
        self.timings[process_set.process_set_id] = timings
        return choose(*fit(timings))

    def forget(self) -> None:
        with self._lock:
            self._chosen.clear()
            self.timings.clear()


MEASURED = Measured()
