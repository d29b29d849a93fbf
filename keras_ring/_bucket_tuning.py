"""The bucket layout chosen from a short measurement at the start of training (``"auto"``).

Horovod's autotuner searches fusion settings while training runs; this is simpler and
deterministic. Before the first reduction every rank times an allreduce of a small and of a
large buffer (the best of a few calls each) and fits ``time = fixed + bytes * per_byte``. A
bucket should be big enough that its fixed cost (signature exchange, dispatch, the ring's
latency) is at most a tenth of its time, and otherwise as small as possible, so that the
first buckets can run while backprop continues: ``bytes >= 9 * fixed / per_byte``, rounded
up to a power of two between ``MIN_BYTES`` and ``MAX_BYTES``; the first bucket is
``FIRST_BYTES`` (PyTorch DDP's first bucket).

Overlap needs a core to run on. A host collective moves and adds bytes on the CPU; when the
host's ranks already give backprop every core (the default: ``init()`` hands each rank
``cores // local_size`` intra-op threads), a collective running during backprop takes its
core from backprop, and the ring's lock-step transfers wait whenever a peer's collective
thread is preempted by that peer's backprop. Measured on a 2-core machine, smaller buckets
then made an MLP step slower, not faster (docs/performance.md). So when some rank has no
spare core (and trains on the CPU), the layout is the one that does not overlap: one bucket
of up to ``FALLBACK_BYTES``, no separate first bucket.

All ranks must plan the same buckets or their collectives would not match: the timings and
the spare-core verdicts are allreduced (Max: the slowest rank's timings; any rank without a
spare core) before the rule runs, so every rank applies the same rule to the same numbers.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import tensorflow as tf

from keras_ring.collectives import Max, Sum, allreduce
from keras_ring.objects import allgather_object
from keras_ring.process_sets import ProcessSet
from keras_ring.runtime import RUNTIME
from keras_ring.threads import available_cores

MIN_BYTES = 1 << 20
MAX_BYTES = 64 << 20
FALLBACK_BYTES = 32 << 20  # no overlap, or timings that make no sense (noise)
FIRST_BYTES = 1 << 20
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


@dataclass(frozen=True)
class Plan:
    """The "auto" layout: sizes of the buckets and of the first one (None: no separate one)."""

    bucket_bytes: int
    first_bucket_bytes: int | None
    overlap: bool  # whether backprop leaves every rank a core for its collectives


def plan(fixed_seconds: float, seconds_per_byte: float, cores_busy: bool) -> Plan:
    if cores_busy:
        return Plan(FALLBACK_BYTES, None, overlap=False)
    return Plan(choose(fixed_seconds, seconds_per_byte), FIRST_BYTES, overlap=True)


def cores_busy() -> bool:
    """Whether this host's ranks leave a rank no core of its own beside backprop's threads."""
    if tf.config.list_logical_devices("GPU"):
        return False  # backprop runs on the GPU; the CPU is free for the collectives
    cores = available_cores()
    threads = tf.config.threading.get_intra_op_parallelism_threads() or cores  # 0: all cores
    local = RUNTIME.topology().local_size
    return cores - local * threads < local


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
        self._plans: dict[int, Plan] = {}
        self.timings: dict[int, list[float]] = {}  # agreed (slowest rank's) probe times

    def plan(self, process_set: ProcessSet) -> Plan:
        """The layout; the first call measures (a collective: every rank must call it)."""
        set_id = process_set.process_set_id
        with self._lock:
            if set_id not in self._plans:
                self._plans[set_id] = self._measure(process_set)
            return self._plans[set_id]

    def _measure(self, process_set: ProcessSet) -> Plan:
        if process_set.size() == 1:
            return Plan(FALLBACK_BYTES, None, overlap=False)  # nothing travels
        # Runs eagerly even while a tf.function traces the training step: at the first
        # trace, which every rank reaches before any of that step's collectives.
        with tf.init_scope():
            local = [_probe(n, process_set) for n in PROBE_BYTES] + [float(cores_busy())]
            agreed = allreduce(tf.constant(local, tf.float64), op=Max,
                               name="bucket_tuning.timings", process_set=process_set)
        *timings, busy = [float(t) for t in agreed.numpy()]
        self.timings[process_set.process_set_id] = timings
        return plan(*fit(timings), cores_busy=busy > 0)

    def kept(self) -> tuple[Plan, list[float]] | None:
        """The whole job's plan and timings, if measured (to carry across an elastic reset)."""
        with self._lock:
            plan = self._plans.get(0)
            return None if plan is None else (plan, self.timings.get(0, []))

    def agree(self, kept: tuple[Plan, list[float]] | None) -> None:
        """Every rank of the world takes the first plan that some rank ``kept`` (a
        collective). In an elastic job the survivors' traced steps keep their buckets: a
        newcomer must plan the same ones, and must not measure alone."""
        everyone = allgather_object(kept, name="keras_ring.bucket_tuning.kept")
        known = next((k for k in everyone if k is not None), None)
        if known is not None:
            with self._lock:
                self._plans[0], self.timings[0] = known

    def forget(self) -> None:
        with self._lock:
            self._plans.clear()
            self.timings.clear()


MEASURED = Measured()
