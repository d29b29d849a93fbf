import ctypes
import os
import select
import sys
from collections import Counter
from pathlib import Path

import pytest

from keras_ring.config import MPI_VARIABLE_PREFIXES

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent

# make test-unit runs two xdist workers that take whole modules (--dist loadscope) in the
# order collected (--no-loadscope-reorder). xdist's own order, by number of tests, put the few
# long modules last, where one of them ran on alone while the other worker had nothing left.
# These take a minute or more on 2 cores (measured with --durations; heaviest first): they
# start first, the short modules fill in around them (the longest-first rule for two machines).
LONG_MODULES = ("test_job_failure.py", "test_faults.py", "test_benchmarks.py",
                "test_api_single_process.py", "test_spark.py", "test_bad_input.py",
                "test_big_ring.py", "test_rendezvous.py", "test_gpu_check_library.py",
                "test_init_comm.py", "test_keras_examples.py", "test_timeline_path.py",
                "test_launcher_failures.py")


def pytest_collection_modifyitems(items):
    """The long modules first, in LONG_MODULES' order; then the rest, those with more tests
    first (xdist's own order); each module's tests keep theirs. Only a run of this suite
    alone: with other suites' modules of the same names, pytest's order stays."""
    here = Path(__file__).resolve().parent
    if any(here not in Path(item.path).resolve().parents for item in items):
        return
    first = {name: i for i, name in enumerate(LONG_MODULES)}
    counts = Counter(item.path.name for item in items)
    items.sort(key=lambda item: (first.get(item.path.name, len(first)), -counts[item.path.name],
                                 item.path.name))


@pytest.fixture
def mpirun():
    """Path of the mpirun that the mpich wheel installed next to this Python."""
    path = VENV_BIN / "mpirun"
    assert path.exists(), f"no mpirun next to {sys.executable}"
    return str(path)


@pytest.fixture
def clean_env():
    """The environment for child processes, without launcher variables of our own process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(MPI_VARIABLE_PREFIXES)}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONPATH"] = str(ROOT)
    return env


def ends_within(pid: int, seconds: float) -> bool:
    """Whether process ``pid`` (not our child) ends within ``seconds``."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], seconds)[0])  # readable once it has ended
    finally:
        os.close(fd)


def signal_a_thread_of(pid: int, sig: int) -> int:
    """Sends ``sig`` to one thread of process ``pid`` other than its main one (tgkill), as the
    kernel may deliver a signal meant for the whole process; returns that thread's id."""
    thread = max(int(t.name) for t in Path(f"/proc/{pid}/task").iterdir())
    assert thread != pid, f"process {pid} runs no thread besides its main one"
    assert ctypes.CDLL(None, use_errno=True).tgkill(pid, thread, sig) == 0, ctypes.get_errno()
    return thread
