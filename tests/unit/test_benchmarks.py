"""The benchmarks behind `make bench` keep working: each runs in a small configuration and
prints complete tables. (No speed is asserted here: speed goals live in docs/performance.md.)"""

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.conftest import ROOT

CORE = ROOT / "keras_ring" / "ops" / "cc"


def _numbers(line: str) -> list[float]:
    return [float(x) for x in re.findall(r"[-+]?\d+(?:\.\d+)?", line)]


def test_allreduce_floor_computes_the_right_sum(tmp_path):
    exe = tmp_path / "floor"
    cxx = shutil.which("g++") or shutil.which("c++")
    subprocess.run([cxx, "-std=c++17", "-O2", f"-I{CORE}", "-o", str(exe),
                    str(ROOT / "benchmarks" / "allreduce_floor.cc"),
                    *(str(CORE / "core" / f) for f in ("copy.cc", "reduce.cc", "common.cc"))],
                   check=True, capture_output=True, text=True)
    proc = subprocess.run([str(exe), "4"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "wrong result" not in proc.stderr, proc.stderr  # the floor really did an allreduce
    match = re.search(r"4 MiB float32: ([\d.]+) us, busbw ([\d.]+) GB/s", proc.stdout)
    assert match and float(match.group(1)) > 0 and float(match.group(2)) > 0, proc.stdout


def _run_table(script: str, mpirun, env) -> subprocess.CompletedProcess:
    """A table benchmark at 2 ranks and the two smallest sizes, 4 KiB and 16 KiB, each cell
    timed briefly (--quick): what is checked is that every cell is there."""
    proc = subprocess.run(
        [mpirun, "-np", "2", sys.executable, str(ROOT / "benchmarks" / script),
         "--min-bytes", "4096", "--max-bytes", "16384", "--quick"],
        env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_allreduce_table_has_every_implementation_and_size(mpirun, clean_env):
    proc = _run_table("allreduce.py", mpirun, clean_env)
    lines = proc.stdout.splitlines()
    header = next(line for line in lines if line.strip().startswith("bytes"))
    for name in ("keras_ring", "grouped x64", "MPI_Allreduce", "tf.function x1", "x64 in graph",
                 "TF alone x64"):
        assert name in header, header
    rows = [line for line in lines if re.match(r"\s+\d+ \|", line)]
    assert [int(r.split("|")[0]) for r in rows] == [4096, 16384], proc.stdout
    for row in rows:
        values = _numbers(row)
        assert len(values) == 1 + 3 * 3 + 3, row  # time, algbw, busbw x3; three times
        assert all(v > 0 for v in values[1:10:3] + values[10:]), row


def test_grouped_table_has_every_count_and_the_ratios(mpirun, clean_env):
    env = dict(clean_env, KERAS_RING_TIMEOUT_SECONDS="60")
    proc = subprocess.run(
        [mpirun, "-np", "2", sys.executable, str(ROOT / "benchmarks" / "grouped.py"),
         "--rounds", "2", "--calls", "2", "--bytes", "262144"],
        env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    header = next(line for line in lines if line.startswith("round"))
    for name in ("single", "TF x1", "x4", "TF x4", "x256", "TF x256", "x64/1"):
        assert name in header, header
    rows = [line for line in lines if re.match(r"\s+\d+ \|", line)]
    assert len(rows) == 2, proc.stdout
    for row in rows:
        values = _numbers(row)
        assert len(values) == 1 + 10 + 4 and all(v > 0 for v in values[1:]), row
    summary = [line for line in lines if line.startswith("# x")]
    assert [line.split(":")[0] for line in summary] == ["# x4/single", "# x16/single",
                                                        "# x64/single", "# x256/single"]


def test_scatter_tables_have_every_implementation_and_size(mpirun, clean_env):
    proc = _run_table("scatter.py", mpirun, clean_env)
    # Each table: its title, the header of names, the units line, then one row per size.
    tables = proc.stdout.split("\n## ")[1:]
    assert [t.split()[0] for t in tables] == ["reducescatter", "alltoall"], proc.stdout
    expected = {
        "reducescatter": (("keras_ring", "tf.function", "MPI_Reduce_scatter", "allreduce",
                           "rs/ar", "MPI_Allreduce", "MPI rs/ar"), 3 * 3 + 4),
        "alltoall": (("keras_ring", "tf.function", "MPI_Alltoallv"), 3 * 3),
    }
    for table in tables:
        names, cells = expected[table.split()[0]]
        header = next(line for line in table.splitlines() if line.strip().startswith("bytes"))
        for name in names:
            assert name in header, header
        rows = [line for line in table.splitlines() if re.match(r"\s+\d+ \|", line)]
        assert [int(r.split("|")[0]) for r in rows] == [4096, 16384], table
        for row in rows:
            values = _numbers(row.split("|", 1)[1])
            assert len(values) == cells, row
            # Times and ratios are positive; a bandwidth may round to 0.00 at these sizes.
            assert all(v > 0 and math.isfinite(v) for v in values[0:9:3] + values[9:]), row


def _rows(script: str, args: list[str], names: tuple[str, ...], env):
    """A one-process benchmark's table rows that start with one of ``names``, by name."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split("|")[0].strip(): _numbers(line.split("|", 1)[1])
            for line in proc.stdout.splitlines() if line.split("|")[0].strip() in names}
    return proc, rows


def test_keras_scaling_table_has_every_bucket_layout(clean_env):
    # One model (the CNN: its worker builds the most layers); each model is a row of its own,
    # and every row starts the same nine processes, so the MLP row adds only time here.
    proc, rows = _rows("keras_scaling.py", ["--ranks", "2", "--steps", "12", "--repeat", "1",
                                            "--models", "cnn"], ("mlp", "cnn"), clean_env)
    assert set(rows) == {"cnn"}, proc.stdout
    for model, (single, base, dist, _, one, _, overlap, _, *rounds) in rows.items():
        assert min(single, base, dist, one, overlap) > 0, (model, proc.stdout)
        assert len(rounds) == 3, (model, proc.stdout)  # one round: default/one bucket/overlap


def test_iterator_teardown_table_times_both_kinds_of_iterator(clean_env):
    proc, rows = _rows("iterator_teardown.py", ["--processes", "1", "--iterators", "2",
                                                "--life", "0.1", "--busy", "1"],
                       ("on", "off"), clean_env)
    assert set(rows) == {"on", "off"}, proc.stdout
    for count, slow, median, worst in rows.values():
        assert count == 2 and 0 <= slow <= 2 and 0 <= median <= worst, proc.stdout


def _cxx() -> str:
    """The compiler make uses (CXX, else g++), so objects from make's build/obj link."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _compile(args: list[str]) -> None:
    cxx = _cxx()
    subprocess.run([cxx, "-std=c++17", "-O1", "-pthread", f"-I{CORE}", *args],
                   check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def core_objects() -> list[str]:
    """The core runtime's objects as `make test-cpp` builds them (build/obj/core): make
    builds what is missing or stale, so after the C++ tests of `make test` this is nothing."""
    sources = sorted((CORE / "core").glob("*.cc")) + sorted((CORE / "core" / "nccl").glob("*.cc"))
    objects = [str(ROOT / "build" / "obj" / src.relative_to(CORE).with_suffix(".o"))
               for src in sources]
    # Not the jobserver of a make that runs this suite: its descriptors are not ours.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    proc = subprocess.run(["make", "--no-print-directory", f"-j{os.cpu_count() or 2}",
                           *(str(Path(o).relative_to(ROOT)) for o in objects)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return objects


def _build_core_bench(tmp_path, source: str, core_objects: list[str]):
    exe = tmp_path / source.replace(".cc", "")
    _compile(["-o", str(exe), str(ROOT / "benchmarks" / source), *core_objects, "-ldl"])
    return exe


def test_agreement_table_counts_fewer_messages_for_the_fast_agreement(tmp_path, core_objects):
    proc = subprocess.run([str(_build_core_bench(tmp_path, "agreement.cc", core_objects)), "8"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = {int(r.split("|")[0]): _numbers(r.split("|", 1)[1])
            for r in proc.stdout.splitlines() if re.match(r"\s+\d+ \|", r)}
    assert sorted(rows) == [2, 3, 4, 6, 8], proc.stdout
    for n, v in rows.items():
        # (time, msgs, bytes) x (barrier full, barrier fast, allreduce full, allreduce fast)
        assert len(v) == 12 and all(x > 0 for x in v), (n, v)
        assert v[1] == n - 1 and v[7] == n - 1, (n, v)  # full: one message to every peer
        # Fast: one message per doubling round, plus the result to rank 0's extra rank.
        p = 1 << int(math.log2(n))
        assert v[4] == int(math.log2(p)) + (1 if n > p else 0), (n, v)
        assert v[4] <= v[1], (n, v)


def test_nccl_host_cost_keeps_64_collectives_in_flight_through_the_fake_gpu(tmp_path,
                                                                           core_objects):
    # Every collective of the window must complete: the benchmark exits 1 naming how many
    # failed (one name for all 64 in flight was refused once a pending name was checked).
    fake = [str(ROOT / "build" / "obj" / "tests" / name)
            for name in ("nccl_fake.o", "nccl_fake_world.o")]
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    made = subprocess.run(["make", "--no-print-directory",
                           *(str(Path(o).relative_to(ROOT)) for o in fake)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert made.returncode == 0, made.stdout + made.stderr
    exe = tmp_path / "nccl_host_cost"
    _compile([f"-I{CORE}", "-o", str(exe), str(ROOT / "benchmarks" / "nccl_host_cost.cc"),
              *core_objects, *fake, "-ldl"])
    proc = subprocess.run([str(exe), "2", "200", "1024", "64", "1"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [r.split() for r in proc.stdout.splitlines() if re.match(r"\s+(1|64)\s", r)]
    assert [r[0] for r in rows] == ["1", "64"], proc.stdout
    for row in rows:
        assert all(float(v) > 0 for cell in row[1:] for v in cell.split("/")), row


def test_allreduce_paths_times_old_and_new_in_forked_processes(tmp_path, core_objects):
    bench = _build_core_bench(tmp_path, "allreduce_paths.cc", core_objects)
    proc = subprocess.run([str(bench), "2", "shm", "16384"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = [r for r in proc.stdout.splitlines() if re.match(r"\s+(\d+|barrier) \|", r)]
    assert [r.split("|")[0].strip() for r in rows] == ["barrier", "4096", "8192", "16384"], \
        proc.stdout
    for row in rows:
        values = _numbers(row.split("|", 1)[1])
        assert len(values) == 3 and all(v > 0 for v in values), row


def test_fastpath_table_has_old_new_and_mpi(mpirun, clean_env):
    proc = _run_table("fastpath.py", mpirun, clean_env)
    rows = [r for r in proc.stdout.splitlines() if re.match(r"\s+\d+ \|", r)]
    assert [int(r.split("|")[0]) for r in rows] == [4096, 16384], proc.stdout
    for row in rows:
        cells = [c.strip() for c in row.split("|")[1:]]
        assert len(cells) == 5 and all(re.fullmatch(r"[\d.]+-[\d.]+", c) for c in cells), row



def test_in_graph_table_has_graph_alone_call_mpi_eager_and_the_ratios(mpirun, clean_env):
    proc = _run_table("in_graph.py", mpirun, clean_env)
    rows = [r for r in proc.stdout.splitlines() if re.match(r"\s+\d+\s+\d+ \|", r)]
    assert [int(r.split()[0]) for r in rows] == [4096, 16384], proc.stdout
    for row in rows:
        chain, times, ratios = (c.split() for c in row.split("|"))
        assert chain[1] == "32", row  # K allreduces per graph call
        assert len(times) == 6 and all(float(t) > 0 for t in times), row
        assert len(ratios) == 4 and all(re.fullmatch(r"[\d.]+-[\d.]+", r) for r in ratios), row


def test_timeline_memory_reports_every_rank_and_writes_the_trace(tmp_path, mpirun, clean_env):
    trace = tmp_path / "trace.json"
    env = dict(clean_env, KERAS_RING_TIMELINE_MEMORY_EVENTS="50")
    proc = subprocess.run([mpirun, "-np", "2", sys.executable,
                           str(ROOT / "benchmarks" / "timeline_memory.py"),
                           "--collectives", "300", "--trace", str(trace)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
    assert [line[:6] for line in lines] == ["rank 0", "rank 1"], proc.stdout
    assert all("300 collectives" in line for line in lines), proc.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    steps = [e for e in events
             if e["name"] == "done" and e["args"]["collective"] == "allreduce 'step'"]
    assert len(steps) == 2 * 300, len(steps)
