"""Multi-host tests: real processes on "hosts" made of network namespaces (see netns.py).

Every job is started by the test (through mpirun, keras-ring-run or the environment
rendezvous) and judged as a whole: every process must end, and every rank's own report is
checked, not only one rank's. The guard below ends a job that hangs; it is never a timing
assertion.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multihost.netns import NS_EXEC, Cluster

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
VENV_BIN = Path(sys.executable).parent
GUARD = 600  # seconds a job may take before it counts as hung


@pytest.fixture
def env() -> dict:
    """A child environment with no launcher variables and no keras_ring variables."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "OMPI_", "HYDRA_", "MPI_", "KERAS_RING_"))}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    return env


@pytest.fixture
def cluster():
    """``cluster(["h0", "h1"])`` makes a Cluster that is torn down after the test."""
    with contextlib.ExitStack() as stack:
        yield lambda hosts: stack.enter_context(Cluster(hosts))


def mpirun_argv(hosts: str, np: int, argv: list[str], ppn: int | None = None) -> list[str]:
    """mpirun across the test hosts: Hydra's ssh launcher, with ns_exec standing in for ssh."""
    cmd = [str(VENV_BIN / "mpirun"), "-launcher", "ssh", "-launcher-exec", str(NS_EXEC),
           "-hosts", hosts, "-np", str(np)]
    if ppn:
        cmd += ["-ppn", str(ppn)]
    return cmd + argv


def finish(procs: list[subprocess.Popen], guard: float = GUARD) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of every process; a job still running at the guard is
    killed and fails the test with everything it printed."""
    outputs = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=guard)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            rest = [p.communicate() for p in procs]
            pytest.fail(f"the job was still running after {guard} s:\n" +
                        "\n".join(f"--- process {i}\n{o}\n{e[-4000:]}" for i, (o, e) in
                                  enumerate(rest)))
        outputs.append((proc.returncode, out, err))
    return outputs


def records(text: str, kind: str) -> list[dict]:
    """The JSON payloads of lines ``KIND {...}`` (also behind a ``[rank] `` prefix)."""
    found = []
    for line in text.splitlines():
        head, sep, payload = line.partition(kind + " {")
        if sep and (not head or head.endswith("] ")):
            found.append(json.loads("{" + payload))
    return found


def describe(outputs: list[tuple[int, str, str]]) -> str:
    """Every process's story, for assertion messages."""
    return "\n".join(f"--- process {i} exited {rc}\n{out[-3000:]}\n{err[-3000:]}"
                     for i, (rc, out, err) in enumerate(outputs))


def pytest_collection_modifyitems(items: list) -> None:
    """The parallel suite's job first: it is half of this suite's time, and the second xdist
    worker takes the other tests beside it (after it, they would wait for it)."""
    items.sort(key=lambda item: item.name != "test_the_parallel_suite_passes_on_two_hosts_of_two_ranks")
