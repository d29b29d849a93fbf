"""One rank of a small keras_ring job with one fault injected; run by tests/unit/test_faults.py.

Usage (under mpirun): ``python fault_child.py SCENARIO FAULT_RANK``

Every rank writes whole lines to stdout that the test parses:

    READY rank=R pid=P
    FAULT rank=R kind=K t=T                       the faulting rank, just before the fault
    RESULT rank=R case=C outcome=ok|error error=CLASS peer=N t=T dt=D coll=... msg=...

``t`` is ``time.monotonic()`` (CLOCK_MONOTONIC, shared by every process on the host), so the
test computes the time from a fault to each rank's error from the children's own clocks;
``dt`` is how long the failing call itself took. ``msg`` is last and runs to the line's end.
A rank that saw an error exits 3; one that saw none exits 0.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys
import threading
import time

import numpy as np
import tensorflow as tf

import keras_ring as kr

SCENARIO = sys.argv[1]
FAULT_RANK = int(sys.argv[2]) if len(sys.argv) > 2 else 1
TIMEOUT = float(os.environ.get("KERAS_RING_TIMEOUT_SECONDS", "300"))
BIG = 1 << 18      # float32 elements: 1 MiB, over the inline size, so data moves in the ring
STEPS = 10_000     # survivors would loop this long without an error (about a minute)

kr.init()
RANK, SIZE = kr.rank(), kr.size()
failed = False


def emit(line: str) -> None:
    # One write(2) per line, under PIPE_BUF: lines of different ranks never interleave.
    os.write(1, (line.replace("\n", " | ")[:3000] + "\n").encode())


def result(case: str, fn) -> bool:
    """Runs ``fn`` and reports it; returns whether it raised."""
    global failed
    start = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - every error is reported, the test judges it
        now = time.monotonic()
        peer = getattr(e, "rank", None)
        emit(f"RESULT rank={RANK} case={case} outcome=error error={type(e).__name__} "
             f"peer={peer} t={now:.4f} dt={now - start:.4f} "
             f"coll={getattr(e, 'collective', None)!s:.80} msg={e}")
        failed = True
        return True
    now = time.monotonic()
    emit(f"RESULT rank={RANK} case={case} outcome=ok error=None peer=None t={now:.4f} "
         f"dt={now - start:.4f} coll=None msg=")
    return False


def fault(kind: str) -> None:
    emit(f"FAULT rank={RANK} kind={kind} t={time.monotonic():.4f}")


def die(how: str) -> None:
    fault(how)
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "exit":
        os._exit(7)
    elif how == "segv":
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file in the test's cwd
        signal.signal(signal.SIGSEGV, signal.SIG_DFL)
        ctypes.string_at(0)
    raise AssertionError(how)


def training_loop(steps: int, at_step=None, name: str = "grad") -> None:
    """Allreduces like a training loop: one large gradient bucket and one small metric."""
    grad = tf.ones([BIG]) * (RANK + 1)
    # Made once: TensorFlow 2.21 segfaults when Python runs a SIGINT handler inside
    # tf.constant's read of its context (EagerTensor_init uses the null handle it gets then),
    # which a Ctrl-C between collectives hit once in ~15 runs of the signal scenario.
    loss = tf.constant([1.0])
    for step in range(steps):
        if at_step is not None:
            at_step(step)
        out = kr.allreduce(grad, op=kr.Sum, name=name)
        kr.allreduce(loss, op=kr.Average, name="loss")
        if step == 0:
            assert float(out[0]) == SIZE * (SIZE + 1) / 2


def scenario_kill(how: str) -> None:
    def at_step(step):
        if RANK != FAULT_RANK or step != 5:
            return
        if how == "sigkill":
            # From another thread while the main one is inside the next large allreduce.
            def later():
                time.sleep(0.005)
                die(how)
            threading.Thread(target=later, daemon=True).start()
        else:
            die(how)

    result("loop", lambda: training_loop(STEPS, at_step))
    # Every later collective fails at once too.
    result("later", lambda: kr.allreduce(tf.ones([4]), name="after_failure"))


def scenario_stall() -> None:
    def at_step(step):
        if RANK == FAULT_RANK and step == 3:
            fault("stall")
            time.sleep(TIMEOUT + 3)

    result("loop", lambda: training_loop(STEPS, at_step))


def scenario_mismatch() -> None:
    last = SIZE - 1
    odd = RANK == FAULT_RANK
    x = tf.ones([1000])  # small: the signature check must catch it without any data path
    big = tf.ones([BIG])
    cases = {
        "shape": lambda: kr.allreduce(tf.ones([1000 + odd]), name="shape_case"),
        "shape_big": lambda: kr.allreduce(tf.ones([BIG + odd]), name="shape_big_case"),
        "dtype": lambda: kr.allreduce(tf.ones([1000], tf.float64 if odd else tf.float32), name="d"),
        "op": lambda: kr.allreduce(big, op=kr.Max if odd else kr.Sum, name="op_case"),
        "root": lambda: kr.broadcast(x, root_rank=last if odd else 0, name="root_case"),
        "root_range": lambda: kr.broadcast(x, root_rank=SIZE if odd else 0, name="w"),
        "name": lambda: kr.allreduce(x, name="other_name" if odd else "the_name"),
        "kind": lambda: (kr.allgather(x, name="k") if odd else kr.allreduce(x, name="k")),
        "gather_rows": lambda: kr.allgather(tf.ones([3, 4 + odd]), name="rows"),
        "grouped": lambda: kr.grouped_allreduce(
            [tf.ones([3]), tf.ones([2])] if odd else [tf.ones([2]), tf.ones([3])], name="g"),
        # Only FAULT_RANK calls 'only_some'; it meets the others' 'next' and fails there, so
        # every rank ran one collective and all stay in step for the check below.
        "only_some": lambda: (kr.allreduce(x, name="only_some") if odd else None,
                              kr.allreduce(x, name="next")),
        # Inside tf.function too (errors come from the graph runtime there).
        "function": lambda: tf.function(lambda t: kr.allreduce(t, name="fn"))(
            tf.ones([5 + odd])),
    }
    for case, call in cases.items():
        result(case, call)
        result(case + "/after", lambda: np.testing.assert_array_equal(
            kr.allreduce(big, op=kr.Sum, name="check").numpy(), np.full([BIG], SIZE, np.float32)))


def scenario_uneven(peers_exit: bool) -> None:
    # One rank has one more batch than the others (an uneven data shard); then every rank
    # averages its epoch metrics, as MetricAverageCallback does at the epoch end.
    steps = 6 + (RANK == FAULT_RANK)

    def epoch():
        training_loop(steps, lambda s: fault("extra_step") if s == 6 else None)
        if not peers_exit:
            kr.allreduce(tf.constant([0.5, 0.25]), op=kr.Average, name="epoch_end.metrics")

    result("epoch", epoch)


def scenario_signal() -> None:
    kr.allreduce(tf.ones([4]), name="warmup")
    emit(f"LOOPING rank={RANK} t={time.monotonic():.4f}")
    try:
        result("loop", lambda: training_loop(STEPS))
    except KeyboardInterrupt:
        # Python's handler raised between ops instead of the op failing: also a prompt end.
        emit(f"RESULT rank={RANK} case=loop outcome=error error=KeyboardInterrupt peer=None "
             f"t={time.monotonic():.4f} dt=0 coll=None msg=KeyboardInterrupt")
        sys.exit(130)


emit(f"READY rank={RANK} pid={os.getpid()}")
if SCENARIO.startswith("kill-"):
    scenario_kill(SCENARIO[len("kill-"):])
elif SCENARIO == "stall":
    scenario_stall()
elif SCENARIO == "mismatch":
    scenario_mismatch()
elif SCENARIO == "uneven":
    scenario_uneven(peers_exit=False)
elif SCENARIO == "uneven-exit":
    scenario_uneven(peers_exit=True)
elif SCENARIO == "signal":
    scenario_signal()
else:
    raise SystemExit(f"unknown scenario {SCENARIO}")
emit(f"DONE rank={RANK} code={3 if failed else 0}")
sys.exit(3 if failed else 0)
