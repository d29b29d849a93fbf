"""Run a keras_ring job inside Spark: ``keras_ring.spark.run(fn)``, no MPI and no SSH.

Each rank is a task of one barrier-mode Spark stage (Spark starts all of them together or
none). The tasks swap what the bootstrap needs through ``BarrierTaskContext.allGather``
(host identity, listener address and port, rank 0's job token), build the same peer table
as the MPI bootstrap, initialize keras_ring, run ``fn``, and shut keras_ring down.

Install with ``pip install keras-ring[spark]``. Importing ``keras_ring`` or this module never
imports pyspark; ``run`` does.

Example:

```python
import keras_ring.spark

def train(epochs):
    import keras, keras_ring          # keras_ring is initialized in here
    ...
    return history.history

histories = keras_ring.spark.run(train, args=(5,), num_proc=4)   # one per rank, rank order
```
"""

from __future__ import annotations

import functools
import json
import os
import re
import secrets
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable

# None of these imports TensorFlow: use_gpu must set the GPUs before TensorFlow loads.
from keras_ring import interfaces
from keras_ring._errors_base import InitError
from keras_ring.config import Config
from keras_ring.peer_table import PeerTable, check_hosts, listen, offered_addresses
from keras_ring.rendezvous import Peer, build_table

# How long a rank whose collective failed because of another rank waits before it reports,
# so that the rank with the root cause is the one whose traceback Spark shows.
_CONSEQUENCE_GRACE_SECONDS = 2.0
_POLL_SECONDS = 0.5
_CANCEL_SECONDS = 30.0
_FAILURE = re.compile(r"keras_ring rank (?P<rank>\d+) of (?P<size>\d+) failed:\n"
                      r"(?P<traceback>.*?)\n\[end of keras_ring rank (?P=rank) traceback\]", re.S)

# A task that died without raising (its Python worker crashed or was killed): Spark names the
# barrier task, whose partition is the rank.
_LOST_TASK = re.compile(r"barrier task ResultTask\(\d+, (?P<rank>\d+)\) finished unsuccessfully"
                        r"\.?\s*(?:\S*Exception: )?(?P<reason>[^\n]*)")


class RankError(RuntimeError):
    """``fn`` (or keras_ring's start) raised in a Spark task.

    Attributes:
        rank: the rank that failed first.
        remote_traceback: that rank's Python traceback, as text.
    """

    def __init__(self, rank: int, size: int, remote_traceback: str):
        super().__init__(f"keras_ring.spark.run: rank {rank} of {size} failed:\n"
                         f"{remote_traceback}")
        self.rank = rank
        self.remote_traceback = remote_traceback


def run(fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None,
        num_proc: int | None = None, use_gpu: bool = False,
        start_timeout: float = 600, env: dict[str, str] | None = None) -> list[Any]:
    """Runs ``fn(*args, **kwargs)`` as a keras_ring job of ``num_proc`` Spark tasks.

    ``fn`` runs with keras_ring already initialized (``keras_ring.init()`` in it is harmless);
    it and its arguments are pickled with cloudpickle, its return value must be picklable.

    Args:
        fn: what every rank runs.
        args: positional arguments for ``fn``.
        kwargs: keyword arguments for ``fn``.
        num_proc: the number of ranks (Spark tasks); default the cluster's
            ``defaultParallelism``. All of them must fit in the cluster at once.
        use_gpu: give each task the GPUs Spark assigned to it (``spark.task.resource.gpu.
            amount``) through ``CUDA_VISIBLE_DEVICES``, before TensorFlow starts.
        start_timeout: seconds Spark may take to start all tasks; past it the job is cancelled
            and ``TimeoutError`` raised.
        env: environment variables every task sets before keras_ring starts (e.g.
            ``KERAS_RING_TIMEOUT_SECONDS``), restored when the task ends (Spark reuses its
            Python workers), as Horovod's ``spark.run(env=...)``.

    Returns:
        ``fn``'s return values, in rank order.

    Raises:
        RankError: ``fn`` raised on some rank; the message holds that rank's traceback (the
            Spark job fails with the same text). The other ranks' collectives fail when the
            failing rank's connections close, so no task hangs.
        TimeoutError: the tasks did not all start within ``start_timeout``.

    Example:

    ```python
    def train():
        import keras_ring
        return keras_ring.rank(), keras_ring.size()

    keras_ring.spark.run(train, num_proc=2)  # [(0, 2), (1, 2)]
    ```
    """
    from pyspark import SparkContext

    sc = SparkContext.getOrCreate()
    num_proc = sc.defaultParallelism if num_proc is None else int(num_proc)
    if num_proc < 1:
        raise ValueError(f"num_proc must be at least 1, got {num_proc}")
    _use_driver_python_locally(sc)
    task = functools.partial(_task, fn, tuple(args), dict(kwargs or {}), bool(use_gpu),
                             {str(k): str(v) for k, v in (env or {}).items()})
    rdd = sc.parallelize(range(num_proc), num_proc).barrier().mapPartitions(task)
    try:
        ranked = _collect(sc, rdd, num_proc, start_timeout)
    except Exception as e:
        failure = _FAILURE.search(str(e))
        if failure is not None:
            raise RankError(int(failure["rank"]), int(failure["size"]),
                            failure["traceback"]) from e
        lost = _LOST_TASK.search(str(e))
        if lost is None:
            raise
        raise RankError(int(lost["rank"]), num_proc,
                        f"its Spark task ended without a Python error: {lost['reason']}") from e
    return [value for _, value in sorted(ranked, key=lambda pair: pair[0])]


def _use_driver_python_locally(sc) -> None:
    """A local Spark starts its Python workers with ``python3`` from PATH unless
    PYSPARK_PYTHON says otherwise: from a virtual environment's Python run without activating
    it, that is another interpreter without TensorFlow. Local workers share the driver's
    machine, so they use the driver's interpreter instead (a cluster's executors keep theirs).
    """
    if sc.master.startswith("local") and not os.environ.get("PYSPARK_PYTHON"):
        sc.pythonExec = sys.executable


def _collect(sc, rdd, num_proc: int, start_timeout: float) -> list:
    """``rdd.collect()``, cancelled if its tasks have not all started within the timeout."""
    group = f"keras_ring-{secrets.token_hex(6)}"
    outcome: dict[str, Any] = {}

    def collect() -> None:
        # Job groups are per thread (pyspark's pinned-thread mode): set it where collect runs.
        sc.setJobGroup(group, f"keras_ring job of {num_proc} ranks", interruptOnCancel=True)
        try:
            outcome["value"] = rdd.collect()
        except BaseException as e:  # noqa: BLE001 - handed to the calling thread
            outcome["error"] = e

    thread = threading.Thread(target=collect, name="keras_ring.spark.run", daemon=True)
    thread.start()
    deadline, started = time.monotonic() + start_timeout, False
    try:
        while thread.is_alive():
            thread.join(_POLL_SECONDS)
            started = started or _started_tasks(sc, group) >= num_proc
            if not started and thread.is_alive() and time.monotonic() > deadline:
                sc.cancelJobGroup(group)
                thread.join(_CANCEL_SECONDS)  # bounded: a job Spark holds back may linger
                raise TimeoutError(
                    f"keras_ring.spark.run: {_started_tasks(sc, group)} of {num_proc} tasks "
                    f"started within start_timeout={start_timeout:g} s; a barrier stage "
                    f"needs {num_proc} free task slots at once")
    except KeyboardInterrupt:
        sc.cancelJobGroup(group)
        raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _started_tasks(sc, group: str) -> int:
    tracker = sc.statusTracker()
    started = 0
    for job_id in tracker.getJobIdsForGroup(group):
        job = tracker.getJobInfo(job_id)
        for stage_id in job.stageIds if job else ():
            stage = tracker.getStageInfo(stage_id)
            if stage:
                started += stage.numActiveTasks + stage.numCompletedTasks + stage.numFailedTasks
    return started


# --- inside each Spark task ------------------------------------------------------------------

def _task(fn: Callable, args: tuple, kwargs: dict, use_gpu: bool, env: dict[str, str],
          _partition) -> list:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return _run_rank(fn, args, kwargs, use_gpu)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _run_rank(fn: Callable, args: tuple, kwargs: dict, use_gpu: bool) -> list:
    from pyspark import BarrierTaskContext

    context = BarrierTaskContext.get()
    rank, size = context.partitionId(), len(context.getTaskInfos())
    table = None
    try:
        if use_gpu:
            _pin_gpus(context)  # before anything imports TensorFlow's GPU runtime
        from keras_ring.runtime import RUNTIME  # imports TensorFlow: after the pinning

        table = _exchange(context, rank, size)
        if RUNTIME.initialized:  # a reused Python worker whose last job did not end cleanly
            RUNTIME.shutdown()
        # Spark ends a failed barrier stage itself: no process needs ending by keras_ring.
        RUNTIME.init(table=table, failure_exit=False)
        result = fn(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001 - reported with its traceback below
        text = traceback.format_exc().rstrip()
        # Leaving with an error makes every peer's collective fail at once, naming this rank.
        _stop(table, error=f"{type(e).__name__}: {e}"[:300])
        if _is_consequence(e):
            time.sleep(_CONSEQUENCE_GRACE_SECONDS)
        raise RuntimeError(f"keras_ring rank {rank} of {size} failed:\n{text}\n"
                           f"[end of keras_ring rank {rank} traceback]") from None
    # No rank shuts down while another may still be finishing its last collective.
    context.barrier()
    _stop(table)
    return [(rank, result)]


def _exchange(context, rank: int, size: int) -> PeerTable:
    """The peer table, from two allGathers: host identities, then listener addresses."""
    config = Config.from_env()
    claims = [json.loads(m) for m in context.allGather(json.dumps(
        [config.host_id or socket.gethostname(), interfaces.network_stack_id()]))]
    host_ids = [h for h, _ in claims]
    problem = check_hosts(host_ids, [st for _, st in claims])
    if problem:  # the same claims on every task: every task raises this
        raise InitError(problem)
    multi_host = len(set(host_ids)) > 1
    # Loopback only when every rank is on this host, as under MPI.
    listener = listen(multi_host, size)
    try:
        # The executor's address as Spark's driver knows it routes goes first; a host name
        # may not (many systems map their own name to 127.0.1.1).
        executor_host = context.getTaskInfos()[rank].address.rpartition(":")[0]
        offered, _ = offered_addresses(config)
        if config.advertise_address is None and executor_host:
            offered = ",".join(dict.fromkeys([executor_host] + offered.split(","))).strip(",")
        token = secrets.randbits(63) if rank == 0 else 0
        entries = [json.loads(m) for m in context.allGather(
            json.dumps([offered, listener.getsockname()[1], token]))]
        peers = [Peer(h, a, p, st) for (h, st), (a, p, _) in zip(claims, entries)]
        return build_table(rank, peers, entries[0][2], listener)
    except BaseException:
        listener.close()
        raise


def _stop(table: PeerTable | None, error: str | None = None) -> None:
    runtime = sys.modules.get("keras_ring.runtime")
    if runtime is not None:
        runtime.RUNTIME.shutdown(error)
    if table is not None:
        table.close()


def _is_consequence(error: BaseException) -> bool:
    """True for a collective that failed because another rank failed or left."""
    errors = sys.modules.get("keras_ring.errors")
    if errors is None:
        return False
    if "tensorflow" in sys.modules:
        import tensorflow as tf

        if isinstance(error, tf.errors.OpError):
            error = errors.translate(error)
    return isinstance(error, (errors.PeerFailureError, errors.CollectiveAbortedError,
                              errors.CollectiveTimeoutError))


def _pin_gpus(context) -> None:
    gpus = context.resources().get("gpu")
    if gpus is None or not gpus.addresses:
        raise RuntimeError(
            "use_gpu=True but Spark assigned this task no GPU: set spark.task.resource.gpu."
            "amount (and spark.executor.resource.gpu.amount with a discovery script)")
    visible = ",".join(gpus.addresses)
    current = os.environ.get("CUDA_VISIBLE_DEVICES")
    if "tensorflow" in sys.modules and current != visible:
        # CUDA reads the variable once; a reused Python worker cannot switch GPUs.
        raise RuntimeError(
            f"Spark assigned GPU(s) {visible}, but this Python worker already loaded "
            f"TensorFlow with CUDA_VISIBLE_DEVICES={current}: set "
            "spark.python.worker.reuse=false for GPU jobs")
    os.environ["CUDA_VISIBLE_DEVICES"] = visible
