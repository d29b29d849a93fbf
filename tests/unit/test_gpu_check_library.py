"""gpu_check's core library as the GPU machine gets it (gpu_check.sh's build, loaded without
TensorFlow, two real processes of it connecting as a user's job does), the script's phases
(a failing one must not hide the others) and the GPU-only scripts it runs. The pure logic is
in test_gpu_check.py."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_gpu_check import ROOT, gc

# ---------------------------------------------------------------- the library the GPU run loads

@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """gpu_check.sh's own build (BUILD_ONLY=1) into a directory of this module's, as the GPU
    machine's g++ builds (libstdc++ linked statically): (the script's run, the library)."""
    import shutil

    tmp = tmp_path_factory.mktemp("gpu_check")
    cxx = tmp / "g++"
    cxx.write_text(f'#!/bin/sh\nexec {shutil.which("g++") or shutil.which("c++")} "$@" -static-libstdc++\n')
    cxx.chmod(0o755)
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")],
                          env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "CXX": str(cxx),
                               "BUILD_ONLY": "1", "OUT": str(tmp), "BUILD_DIR": str(tmp / "build")},
                          capture_output=True, text=True, timeout=600)
    return proc, tmp / "build" / "libkeras_ring_core.so"


def test_the_core_library_builds_without_tensorflow_loads_and_reports_a_missing_gpu(built):
    """What every rank does first on the GPU machine with gpu_check.sh's build: load the
    library, init, a barrier, a device allreduce. Here there is no CUDA, so the allreduce
    must fail cleanly with FAILED_PRECONDITION, and the runtime still shut down.
    A source missing from the script's list once built a library that could not load.
    Built as the GPU machine's g++ builds (libstdc++ linked statically): exported, that copy
    mixed locale facets with the process's libstdc++.so.6 and crashed the first message that
    printed a double, so the library must export none of it."""
    import socket

    proc, library = built
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "linked libstdc++ statically (kept private" in proc.stdout, proc.stdout
    exported = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True,
                              text=True, check=True).stdout.split()
    assert "keras_ring_device_allreduce" in exported
    assert not [name for name in exported if name.startswith(("_ZNSo", "_ZNSt6locale"))]
    # The probe's Python model of NCCL's one-rank kernel is plan.cc's, not a drifting copy.
    import ctypes

    writes = ctypes.CDLL(str(library))["_ZN10keras_ring4nccl19OneRankKernelWritesEmm"]
    writes.restype, writes.argtypes = ctypes.c_size_t, [ctypes.c_size_t, ctypes.c_size_t]
    for esize in (1, 2, 4, 8):
        for count in [*range(0, 5000, 7), *range(5000, (3 << 20) // esize, 9973),
                      *gc.one_rank.cut_counts(esize, 20)]:
            assert writes(count, esize) == gc.one_rank.kernel_writes(count, esize), (count, esize)
    core = gc.Core(str(library))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    core.init(0, 1, listener, [listener.getsockname()[1]], token=7, timeout=30.0)
    try:
        core.barrier()
        with pytest.raises(gc.CollectiveError, match="allreduce #2 failed on rank 0") as failed:
            core._check(core.c.keras_ring_device_allreduce(
                None, None, 8, gc.DTYPES["float32"], gc.OPS["Sum"], 1.0, 1.0, 0, None, None,
                core.err, len(core.err)))
        assert failed.value.code == 9, failed.value  # FAILED_PRECONDITION: no usable CUDA
    finally:
        core.shutdown()
        listener.close()


PHASES = ((gc, "check_allreduce"), (gc, "check_ordering"), (gc, "check_allgather_broadcast"),
          (gc.scatter, "check_reducescatter"), (gc.scatter, "check_alltoall"),
          (gc.cases, "check_grouped"), (gc.cases, "check_edge_cases"),
          (gc.cases, "check_first_latency"), (gc.cases, "check_many_small"),
          (gc.cases, "check_process"), (gc.inflight, "check_in_flight"))


def _phases_that_record(monkeypatch, failing: str, error: Exception) -> list[str]:
    ran = []

    def phase(name):
        def run(*args):
            ran.append(name)
            if name == failing:
                raise error
            return {}
        return run

    for module, name in PHASES:
        monkeypatch.setattr(module, name, phase(name))
    monkeypatch.setitem(sys.modules, "gpu_check", gc)  # run_checks passes its own module on
    return ran


def test_a_phase_failing_outside_a_collective_is_a_failed_check_and_the_rest_run(monkeypatch, capsys):
    # CuPy without cuBLAS, say: one GPU run must still report everything else.
    ran = _phases_that_record(monkeypatch, "check_ordering", ImportError("no cuBLAS"))
    checks = gc.Checks(0)
    gc.run_checks(None, None, checks, rank=0, n=2, device=0)
    assert sorted(ran) == sorted(name for _, name in PHASES)
    assert len(checks.failed) == 1 and "ordering: the phase ran" in str(checks.failed[0])
    assert "ImportError: no cuBLAS" in str(checks.failed[0])
    assert "ordering ..." in capsys.readouterr().out  # each phase announced, with the time


def test_a_fatal_collective_error_still_ends_the_checks(monkeypatch):
    ran = _phases_that_record(monkeypatch, "check_allreduce", gc.CollectiveError(14, "lost rank 1"))
    with pytest.raises(gc.CollectiveError, match="lost rank 1"):
        gc.run_checks(None, None, gc.Checks(0), rank=0, n=2, device=0)
    assert ran == ["check_first_latency", "check_allreduce"]


def test_gpu_only_scripts_compile_and_the_nccl_probe_runs_in_the_check():
    # They need CUDA and CuPy, so this machine can only compile them.
    scripts = sorted((ROOT / "benchmarks").glob("gpu_check*.py"))
    assert ROOT / "benchmarks" / "gpu_check_nccl_one_rank.py" in scripts
    for path in scripts:
        compile(path.read_text(), str(path), "exec")
    assert "gpu_check_nccl_one_rank.py" in (ROOT / "benchmarks" / "gpu_check.sh").read_text()


_TWO_RANKS = """
import os, socket, sys, time
sys.path.insert(0, sys.argv[3])
import gpu_check as gc
rank, shared = int(sys.argv[1]), sys.argv[2]
core = gc.Core(sys.argv[4])
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(2)
gc.Path(shared, f"port{rank}.tmp").write_text(str(listener.getsockname()[1]))
os.replace(gc.Path(shared, f"port{rank}.tmp"), gc.Path(shared, f"port{rank}"))
while not all(gc.Path(shared, f"port{r}").exists() for r in range(2)):
    time.sleep(0.01)
ports = [int(gc.Path(shared, f"port{r}").read_text()) for r in range(2)]
core.init(rank, 2, listener, ports, token=23, timeout=60.0)
us = gc.inflight.control_round_trip_us(core, 200)
core.shutdown()
print(core.control_path, "|", " ".join(f"{u:.3f}" for u in us))
"""


@pytest.mark.parametrize("env, path", [({}, "shared memory, fast agreement"),
                                       ({"KERAS_RING_SHM": "0", "KERAS_RING_FAST_AGREE": "0"},
                                        "TCP, full agreement")])
def test_gpu_check_ranks_agree_as_a_users_job_on_one_host_does(tmp_path, built, env, path):
    """Two real processes of gpu_check's core library: they connect with a user's defaults
    (shared memory, the fast agreement; the first GPU runs at 2 ranks used TCP and the full
    exchange, which no user gets), the same KERAS_RING_* variables change that, and the
    control path's round trip (barriers) is measured on every rank."""
    import os

    proc, library = built
    assert proc.returncode == 0, proc.stdout + proc.stderr
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("KERAS_RING_")}
    child_env.update(env, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", _TWO_RANKS, str(r), str(tmp_path),
                               str(ROOT / "benchmarks"), str(library)], env=child_env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    outputs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, out + err
        described, timings = out.strip().rsplit("|", 1)
        assert described.strip() == path
        assert len(timings.split()) == gc.inflight.REPEATS
        assert all(float(u) > 0 for u in timings.split()), timings
