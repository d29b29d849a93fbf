"""The pure logic of benchmarks/gpu_check.py and its case and fault modules (the GPU machine
runs the rest): reference results, dtype handling, the benchmark plan and the table, what the
process maps and nvidia-smi say, how each failure scenario is judged, and the script's refusal
to run fewer ranks than asked. A wrong reference or judgement there would make a correct GPU
run fail, or a wrong one pass."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
gc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gc)  # test_gpu_check_library.py uses this module too


def test_bfloat16_bits_round_to_nearest_even():
    values = np.array([1.0, -2.5, 3.0e-3, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8], np.float32)
    bits = gc.bf16_bits(values)
    assert bits[0] == 0x3F80 and bits[1] == 0xC020
    assert gc.bf16_values(bits[3:]).tolist() == [1.0, 1.0 + 2 ** -6]  # ties to even
    assert abs(gc.bf16_values(bits[2:3])[0] - 3.0e-3) < 3.0e-3 * 2 ** -8


@pytest.mark.parametrize("name", list(gc.DTYPES))
def test_inputs_are_deterministic_and_in_their_storage_type(name):
    a = gc.rank_input(name, "Sum", 1000, rank=1)
    assert a.dtype == gc.storage_dtype(name)
    assert np.array_equal(a, gc.rank_input(name, "Sum", 1000, rank=1))
    assert not np.array_equal(a, gc.rank_input(name, "Sum", 1000, rank=0))


def test_integer_average_truncates_toward_zero_and_sums_wrap():
    inputs = [np.array([-3, 3, 7, -7], np.int32), np.array([0, 0, 0, 0], np.int32)]
    assert gc.reference_allreduce("int32", "Average", inputs).tolist() == [-1, 1, 3, -3]
    u = [np.array([200], np.uint8), np.array([100], np.uint8)]
    assert gc.reference_allreduce("uint8", "Sum", u).tolist() == [44]


def test_float_reference_applies_scale_factors_around_the_reduction():
    inputs = [np.array([2.0, -4.0]), np.array([3.0, -4.0])]
    got = gc.reference_allreduce("float64", "Average", inputs, prescale=0.5, postscale=3.0)
    assert got.tolist() == [3.75, -6.0]
    assert gc.reference_allreduce("float64", "Max", inputs).tolist() == [3.0, -4.0]
    bf = [gc.bf16_bits(np.array([1.5], np.float32)), gc.bf16_bits(np.array([2.0], np.float32))]
    assert gc.bf16_values(gc.reference_allreduce("bfloat16", "Sum", bf)).tolist() == [3.5]


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32", "int8", "uint8", "int64"])
@pytest.mark.parametrize("op", list(gc.OPS))
def test_references_of_generated_inputs_are_exact_where_the_gpu_must_be(name, op):
    # Small integers (and products of halves and ones) stay exact in every dtype, so the
    # tolerances only absorb NCCL's own rounding of Average's 1/n.
    inputs = [gc.rank_input(name, op, 4096, r) for r in range(2)]
    want = gc.reference_allreduce(name, op, inputs)
    exact = np.stack([gc.as_float64(name, x) for x in inputs])
    exact = {"Sum": exact.sum(0), "Average": exact.sum(0) / 2, "Min": exact.min(0),
             "Max": exact.max(0), "Product": exact.prod(0)}[op]
    if name in gc.RTOL or op != "Average":
        assert np.array_equal(gc.as_float64(name, want), exact)
    else:  # integer Average truncates toward zero, which the exact mean shows where it may
        assert np.array_equal(gc.as_float64(name, want), np.trunc(exact))
    # close() accepts the reference and refuses it one unit (or more than RTOL) away.
    assert gc.close(name, want, want)
    bumped = gc.as_float64(name, want) + np.maximum(1.0, np.abs(gc.as_float64(name, want)) * 0.5)
    bumped = (gc.bf16_bits(bumped.astype(np.float32)) if name == "bfloat16"
              else bumped.astype(gc.storage_dtype(name)))
    assert not gc.close(name, want, bumped)


def test_close_is_exact_for_integers_and_relative_for_floats():
    assert not gc.close("int32", np.array([1]), np.array([2]))
    assert gc.close("float32", np.array([1.0], np.float32), np.array([1.0 + 1e-7], np.float32))
    assert not gc.close("float32", np.array([1.0], np.float32), np.array([1.001], np.float32))
    assert not gc.close("float32", np.zeros(2, np.float32), np.zeros(3, np.float32))


def test_benchmark_plan_is_the_same_everywhere_and_bounded():
    sizes = gc.bench_sizes(1 << 28)
    assert sizes[0] == 8 and sizes[-1] <= 1 << 28 and len(sizes) == 13
    iters = [gc.iterations(s) for s in sizes]
    assert iters == sorted(iters, reverse=True) and iters[0] == 200 and iters[-1] == 5
    # Worst case on a slow link (10 GB/s): the timed loops stay well under a minute.
    assert sum(i * max(s, 1 << 16) / 10e9 for i, s in zip(iters, sizes)) < 30


def test_bus_bandwidth_is_nccl_tests_definition():
    assert gc.bandwidths(1_000_000_000, 1.0, 2) == (1.0, 1.0)
    assert gc.bandwidths(1_000_000_000, 0.5, 4) == (2.0, 3.0)
    assert gc.bandwidths(1_000_000_000, 1.0, 1) == (1.0, 0.0)  # one rank: no bus


def test_a_world_of_one_runs_the_stall_and_reinit_but_never_passes(capsys, tmp_path):
    # A killed rank would be the only rank, and nobody would be left to judge; a stalled GPU
    # and init after shutdown mean the same at one rank.
    started = []
    f = gc.faults
    args = type("Args", (), {"spawn": 1, "timeout": 60, "shared": str(tmp_path), "json": None})()

    def spawn(_, name):
        started.append(name)
        f.report(args.shared, name, 0, {"code": 0, "values": [1.0, 1.0], "communicators": 1}
                 if name == "reinit" else _reports(1, code=4, failed_call_s=f.TIMEOUT["stall"])[0])
        return [0]

    assert f.run_all(args, spawn) == 4  # both passed, yet incomplete
    out = capsys.readouterr().out
    assert started == ["stall", "reinit"] and "kill need 2 ranks" in out, out
    assert "# fault stall: ok" in out and "# fault reinit: ok" in out, out
    args.spawn = 0
    assert f.run_all(args, lambda *a: pytest.fail("a job was started")) == 4


def test_table_shows_both_implementations_or_only_keras_ring():
    rows = [{"bytes": 1024, "kr_us": 12.5, "kr_algbw": 0.08, "kr_busbw": 0.08,
             "torch_us": 10.0, "torch_algbw": 0.1, "torch_busbw": 0.1}]
    text = gc.table(rows, 2, "torch 2.5 nccl 2.21.5")
    assert "keras_ring us" in text and "torch 2.5 nccl 2.21.5 us" in text and "12.5" in text
    assert "torch" not in gc.table(rows, 2, None)


def test_version_strings():
    assert gc.nccl_version_string(23004) == "2.30.4"
    assert gc.nccl_version_string(2804) == "2.8.4"


def test_the_shell_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_check.sh")], check=True)


def test_loaded_libraries_are_read_from_the_process_maps():
    maps = "\n".join([
        "7f00-7f10 r-xp 00000000 08:01 1 /opt/v/nvidia/cu13/lib/libcudart.so.13",
        "7f10-7f20 r--p 00010000 08:01 1 /opt/v/nvidia/cu13/lib/libcudart.so.13",
        "7f20-7f30 r-xp 00000000 08:01 2 /opt/v/nvidia/nccl/lib/libnccl.so.2",
        "7f30-7f40 rw-p 00000000 00:00 0 ",
        "7f40-7f50 r-xp 00000000 08:01 3 /usr/lib/libnccl-net.so",
    ])
    assert gc.cases.mapped_libraries(maps) == {
        "libcudart": ["/opt/v/nvidia/cu13/lib/libcudart.so.13"],
        "libnccl": ["/opt/v/nvidia/nccl/lib/libnccl.so.2"]}


def test_contexts_on_other_gpus_are_found_by_pid_and_bus_id():
    rows = "101, 00000000:19:00.0\n202, 00000000:19:00.0\n101, 00000000:3B:00.0\n"
    assert gc.cases.foreign_gpus(rows, 202, "0000:19:00.0") == []
    assert gc.cases.foreign_gpus(rows, 101, "0000:19:00.0") == ["3b:00.0"]
    assert gc.cases.foreign_gpus(rows, 303, "0000:19:00.0") is None  # not listed: unknown


def test_memory_drift_tolerates_little_and_catches_a_leak():
    assert gc.cases.memory_stable(10 << 30, (10 << 30) - (8 << 20))
    assert gc.cases.memory_stable(10 << 30, (10 << 30) + (1 << 20))
    assert not gc.cases.memory_stable(10 << 30, (10 << 30) - 10_000 * 16_384)  # 16 KiB a call


def test_grouped_references_are_each_members_own():
    members = gc.cases.GROUP
    by_rank = [gc.cases.group_inputs(gc, members, r) for r in range(3)]
    want = gc.cases.group_reference(gc, members, by_rank, "Sum")
    assert [w.dtype for w in want] == [gc.storage_dtype(name) for name, _ in members]
    assert [w.size for w in want] == [count for _, count in members]
    assert any(count == 0 for _, count in members)  # an empty member
    scaled = gc.cases.SCALED_GROUP
    assert {name for name, _ in scaled} >= {"float16", "bfloat16"}
    by_rank = [gc.cases.group_inputs(gc, scaled, r, "Average") for r in range(2)]
    got = gc.cases.group_reference(gc, scaled, by_rank, "Average", 0.5, 3.0)
    exact = (gc.as_float64("float16", by_rank[0][0]) + gc.as_float64("float16", by_rank[1][0])) * 0.75
    assert np.allclose(gc.as_float64("float16", got[0]), exact, rtol=2e-3)


def _reports(n, **overrides):
    ok = {"code": 14, "failed_call_s": 0.4, "later_code": 14, "shutdown_s": 0.2}
    return {r: dict(ok, **overrides) for r in range(n)}


def test_a_killed_rank_is_judged_by_the_survivors_promptness_and_exit():
    f = gc.faults
    n = 3
    assert f.judge("kill", n, [0, 0, -9], _reports(n - 1)) == []
    assert f.judge("kill", n, [0, 0, 0], _reports(n - 1)) == ["rank 2 (killed) exited with 0"]
    slow = f.judge("kill", n, [0, 0, -9], _reports(n - 1, failed_call_s=29.0))
    assert len(slow) == 2 and "not promptly" in slow[0]
    assert "not refused" in f.judge("kill", n, [0, 0, -9], _reports(n - 1, later_code=0))[0]
    assert "not cleanly" in f.judge("kill", n, [0, 70, -9], _reports(n - 1))[0]
    assert "reported nothing" in f.judge("kill", n, [0, 0, -9], {0: _reports(1)[0]})[0]


def test_a_stalled_gpu_must_end_in_a_timeout_at_the_deadline():
    f = gc.faults
    good = _reports(2, code=4, failed_call_s=f.TIMEOUT["stall"] + 0.5)
    assert f.judge("stall", 2, [0, 0], good) == []
    assert "expected a timeout" in f.judge("stall", 2, [0, 0], _reports(2, failed_call_s=10.2))[0]
    early = f.judge("stall", 2, [0, 0], _reports(2, code=4, failed_call_s=1.0))
    assert "ended after 1.0 s" in early[0]
    slow_exit = {0: good[0], 1: dict(good[1], shutdown_s=40.0)}
    assert "shutdown took" in f.judge("stall", 2, [0, 0], slow_exit)[0]


def test_init_after_shutdown_needs_both_results_and_one_communicator():
    f = gc.faults
    good = {r: {"code": 0, "values": [2.0, 2.0], "communicators": 1} for r in range(2)}
    assert f.judge("reinit", 2, [0, 0], good) == []
    bad = {0: good[0], 1: {"code": 0, "values": [2.0], "communicators": 1}}
    assert f.judge("reinit", 2, [0, 0], bad) != []


def test_ranks_share_gpus_only_where_nccl_allows_it(monkeypatch):
    for name in ("NCCL_MULTI_RANK_GPU_ENABLE", "NCCL_MAX_CTAS"):
        monkeypatch.delenv(name, raising=False)
    for module, name in ((gc, "ITERATION_CAP"), (gc.cases, "STABLE_ITERATIONS"),
                         (gc.inflight, "ALLREDUCES")):
        monkeypatch.setattr(module, name, getattr(module, name))  # restored afterwards
    full = (gc.iterations(4096), gc.cases.STABLE_ITERATIONS, gc.inflight.ALLREDUCES)
    assert gc.share_gpu_setup(gpus=2, n=2, nccl_code=22703) is None
    assert "NCCL_MAX_CTAS" not in gc.os.environ  # own GPUs: NCCL's defaults
    reason = gc.share_gpu_setup(gpus=1, n=2, nccl_code=22703)
    assert "needs NCCL >= 2.30" in reason and "not running fewer ranks" in reason
    assert gc.share_gpu_setup(gpus=1, n=2, nccl_code=23004) is None
    assert gc.os.environ["NCCL_MULTI_RANK_GPU_ENABLE"] == "1"
    assert int(gc.os.environ["NCCL_MAX_CTAS"]) > 0
    # Sharing ranks take turns on the GPU: every count is cut, to stay within the time limit.
    shared = (gc.iterations(4096), gc.cases.STABLE_ITERATIONS, gc.inflight.ALLREDUCES)
    assert all(s * 5 <= f for s, f in zip(shared, full)), (shared, full)


def test_with_an_old_nccl_the_script_runs_one_rank_per_gpu_and_never_passes(tmp_path):
    # A stand-in python: every package imports, CuPy sees 1 GPU, the newest NCCL is 2.27, and
    # every run of the checks "passes". Two ranks cannot share the GPU with that NCCL: the
    # script runs one rank (the library, NCCL and the host cost still get checked), skips the
    # failure scenarios (two ranks each) and exits 4, not 0. The build is not what is tested
    # here (test_gpu_check_library builds for real): a stand-in compiler writes empty files.
    cxx = tmp_path / "g++"
    cxx.write_text('#!/bin/bash\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && : > "$2"; shift; done\n')
    cxx.chmod(0o755)
    fake = tmp_path / "python"
    fake.write_text("#!/bin/bash\n"
                    'echo "$*" >> "$(dirname "$0")/calls"\n'
                    'case "$*" in\n'
                    '  *--find-nccl*) echo "1 /opt/nccl 22703";;\n'
                    '  --version) echo "Python 3.12";;\n'
                    '  -) cat >/dev/null;;\n'
                    "esac\n")
    fake.chmod(0o755)
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")],
                          env={"PATH": "/usr/bin:/bin", "PYTHON": str(fake), "NP": "2",
                               "CXX": str(cxx), "OUT": str(tmp_path / "out"),
                               "BUILD_DIR": str(tmp_path / "build")},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "2 ranks would share 1 GPU(s), which needs NCCL >= 2.30" in proc.stdout
    assert "running 1 rank(s) started by the driver" in proc.stdout
    assert "failure scenarios on 1 rank(s)" in proc.stdout
    assert "incomplete: ran 1 of the 2" in proc.stdout
    calls = (tmp_path / "calls").read_text().splitlines()
    assert [c for c in calls if "--spawn" in c] == [c for c in calls if "--spawn 1 " in c] != []
    assert [c for c in calls if "--faults" in c] == [c for c in calls if "--faults 1 " in c] != []


# ---------------------------------------------------------------- reducescatter and alltoall

sc = gc.scatter


def test_reducescatter_reference_is_each_ranks_rows_of_the_allreduce():
    assert sc.scatter_rows(7, 3) == [3, 2, 2] and sc.scatter_rows(2, 3) == [1, 1, 0]
    assert sc.scatter_row_counts(3) == (9, 10, 2)  # even, uneven, an empty part
    inputs = [gc.rank_input("int64", "Sum", 7 * 2, r).reshape(7, 2) for r in range(3)]
    full = inputs[0] + inputs[1] + inputs[2]
    assert np.array_equal(sc.reference_reducescatter(gc, "int64", "Sum", inputs, 1), full[3:5])
    assert np.array_equal(sc.reference_reducescatter(gc, "int64", "Sum", inputs, 0), full[:3])
    small = [x[:2] for x in inputs]
    assert sc.reference_reducescatter(gc, "int64", "Sum", small, 2).shape == (0, 2)


def test_alltoall_reference_takes_the_rows_each_rank_addressed_to_this_one():
    inputs = [np.arange(3)[:, None] + 10 * r for r in range(3)]  # rank r's rows: 10r, 10r+1, ...
    splits = [[1, 0, 2], [0, 3, 0], [2, 1, 0]]
    out, received = sc.reference_alltoall(inputs, splits, 2)
    assert out[:, 0].tolist() == [1, 2] and received == [2, 0, 0]
    out, received = sc.reference_alltoall(inputs, splits, 1)
    assert out[:, 0].tolist() == [10, 11, 12, 22] and received == [0, 3, 1]
    equal = [np.arange(4)[:, None] + 10 * r for r in range(2)]
    assert sc.reference_alltoall(equal, None, 1)[0][:, 0].tolist() == [2, 3, 12, 13]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_alltoall_cases_cover_empty_transfers_and_a_silent_rank(n):
    for case in ("uneven", "silent", "large"):
        splits = sc.alltoall_splits(case, n)
        assert len(splits) == n and all(len(s) == n and min(s) >= 0 for s in splits)
    assert any(0 in s for s in sc.alltoall_splits("uneven", n))
    assert sum(sc.alltoall_splits("silent", n)[0]) == 0
    assert sc.alltoall_splits("equal", n) is None and sc.rows_to_send(None, 0, n) == 2 * n


class _NumpyAsCupy:
    """Just enough of CuPy for the checks: host arrays."""
    float32 = np.float32
    asarray, asnumpy, empty, ones = staticmethod(np.asarray), staticmethod(np.asarray), \
        staticmethod(np.empty), staticmethod(np.ones)


class _ThreadWorld:
    """Ranks as threads running the checks against collectives done in NumPy, written apart
    from the references (np.array_split for the parts, cumulative offsets for the rows);
    `wrong` breaks one thing to show the checks notice."""

    def __init__(self, n, wrong=None):
        import threading
        self.n, self.wrong, self.slots = n, wrong, [None] * n
        self.barrier = threading.Barrier(n)

    def _gather(self, rank, value):
        self.slots[rank] = value
        self.barrier.wait()
        everything = list(self.slots)
        self.barrier.wait()
        return everything

    def reducescatter(self, x, y, name, op, device, pre=1.0, post=1.0):
        rank = self._rank()
        inputs = self._gather(rank, np.array(x))
        if op not in ("Sum", "Average") and pre != 1.0:
            raise gc.CollectiveError(3, "not supported")
        full = gc.reference_allreduce(name, op, inputs, pre, post)
        part = np.array_split(full, self.n)[(rank + 1) % self.n if self.wrong == "part" else rank]
        y[...] = part if part.shape == y.shape else 0

    def alltoall(self, x, out, name, splits, device):
        rank = self._rank()
        deposits = self._gather(rank, (np.array(x), splits))
        sizes = [s if s is not None else [len(a) // self.n] * self.n for a, s in deposits]
        for p, (a, _) in enumerate(deposits):
            if sum(sizes[p]) != len(a):
                raise gc.CollectiveError(3, f"rank {p} passed splits {sizes[p]}")
        rows = [a[int(np.sum(sizes[p][:rank])):][:sizes[p][rank]] for p, (a, _) in enumerate(deposits)]
        got = np.concatenate(rows)
        out[:len(got)] = got
        received = [sizes[p][rank] for p in range(self.n)]
        return received[::-1] if self.wrong == "received" else received

    def _rank(self):
        import threading
        return int(threading.current_thread().name)


def _run_checks(world, check):
    import threading
    results = [gc.Checks(r) for r in range(world.n)]
    threads = [threading.Thread(name=str(r), target=check, args=(
        gc, world, _NumpyAsCupy, results[r], r, world.n, 0)) for r in range(world.n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results


@pytest.mark.parametrize("n", [2, 3])
def test_scatter_checks_pass_on_right_results_and_fail_on_wrong_ones(n):
    for check, wrong in ((sc.check_reducescatter, "part"), (sc.check_alltoall, "received")):
        good = _run_checks(_ThreadWorld(n), check)
        assert all(c.failed == [] and c.passed > 5 for c in good), [c.failed for c in good]
        bad = _run_checks(_ThreadWorld(n, wrong), check)
        assert all(c.failed for c in bad), check.__name__


def test_gpu_check_runs_the_scatter_checks_through_the_c_api():
    assert hasattr(gc.Core, "reducescatter") and hasattr(gc.Core, "alltoall")
    import inspect
    source = inspect.getsource(gc.run_checks)
    assert "scatter.check_reducescatter" in source and "scatter.check_alltoall" in source


def test_in_flight_table_shows_every_window_and_repeat():
    text = gc.inflight.in_flight_table({64: [15.25, 14.0], 1: [80.0, 79.5]}, 2)
    lines = text.splitlines()
    assert "2 ranks" in lines[0] and "1024 B" in lines[0]
    rows = [line.split() for line in lines if not line.startswith("#")]
    assert rows == [["1", "80.0", "79.5"], ["64", "15.2", "14.0"]]  # windows in order


def test_gpu_check_measures_collectives_in_flight_through_the_c_api():
    assert hasattr(gc.Core, "allreduce_window")
    assert gc.inflight.WINDOWS == (1, 64)
    import inspect
    assert "inflight.check_in_flight" in inspect.getsource(gc.run_checks)


def test_the_barrier_names_the_global_process_set():
    calls = []

    class C:
        def keras_ring_barrier(self, *args):
            calls.append(args)
            return 0

    core = gc.Core.__new__(gc.Core)
    core.c, core.err = C(), bytearray(16)
    core.barrier()
    assert calls and calls[0][0] == 0 and calls[0][1] == b"gpu_check"


class _WindowWorld:
    """Ranks as threads for gpu_check_inflight: allreduce_window reduces each buffer across
    the ranks with Max in NumPy (`wrong`: one buffer gets the Min instead)."""

    def __init__(self, n, wrong=False, lookahead=True):
        import threading
        self.n, self.wrong, self.slots = n, wrong, [None] * n
        self.fence = threading.Barrier(n)
        self.lookahead, self.rounds = lookahead, {}

    def barrier(self):
        self.fence.wait()

    def allreduce_window(self, buffers, count, dtype, op, n, window, device, stream=0):
        import threading
        assert op == gc.OPS["Max"] and 1 <= window <= 64 and n >= window
        rank = int(threading.current_thread().name)
        # One round per window of queued collectives with the lookahead, else one each.
        self.rounds[rank] = self.rounds.get(rank, 0) + (-(-n // window) if self.lookahead else n)
        self.slots[rank] = [np.array(b) for b in buffers]
        self.fence.wait()
        for i, b in enumerate(buffers):
            reduce = np.min if self.wrong and i == 5 else np.max
            b[...] = reduce([s[i] for s in self.slots], axis=0)
        self.fence.wait()
        return 0.0

    def agreement_rounds(self):
        import threading
        return self.rounds.get(int(threading.current_thread().name), 0)


class _CupyWithFull(_NumpyAsCupy):
    full = staticmethod(np.full)

    class cuda:
        class runtime:
            @staticmethod
            def deviceSynchronize():
                pass


@pytest.mark.parametrize("n", [2, 3])
def test_in_flight_check_passes_on_right_results_and_fails_on_wrong_ones(n):
    import threading

    def run(world):
        results = [gc.Checks(r) for r in range(n)]
        extra = [None] * n

        def rank(r):
            extra[r] = gc.inflight.check_in_flight(gc, world, _CupyWithFull, results[r], r, n, 0)

        threads = [threading.Thread(name=str(r), target=rank, args=(r,)) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        return results, extra

    good, extra = run(_WindowWorld(n))
    assert all(c.failed == [] and c.passed == 2 for c in good), [c.failed for c in good]
    assert sorted(extra[0]["in_flight_us"]) == ["1", "64"]
    assert all(len(v) == gc.inflight.REPEATS for v in extra[0]["in_flight_us"].values())
    assert len(extra[0]["barrier_us"]) == gc.inflight.REPEATS
    collectives = gc.inflight.REPEATS * gc.inflight.ALLREDUCES
    assert extra[0]["agreement_rounds"] == {
        "1": collectives, "64": gc.inflight.REPEATS * -(-gc.inflight.ALLREDUCES // 64)}
    bad, _ = run(_WindowWorld(n, wrong=True))
    assert all(c.failed for c in bad)
    one_each, _ = run(_WindowWorld(n, lookahead=False))  # a round per collective
    assert all([f.split(":")[0] for f in c.failed] == ["64 in flight"] for c in one_each), \
        [c.failed for c in one_each]


def test_mismatch_names_how_many_elements_differ_and_where():
    want = np.arange(10, dtype=np.float32)
    got = want.copy()
    got[7:] = -7.0
    text = gc.mismatch("float32", got, want)
    assert text.startswith("3 of 10 elements differ, indices 7..9"), text
    assert "[7] got -7.0 want 7.0" in text, text
    assert gc.mismatch("int32", want.astype(np.int32), want.astype(np.int32)) == "no element differs"
    assert gc.mismatch("float32", got[:4], want) == "shape (4,), expected (10,)"


def test_the_one_rank_kernel_model_and_the_lengths_it_cuts():
    one_rank = gc.one_rank
    # The H200 run: NCCL 2.28.9 wrote 2^20 of 2^20 + 7 elements, all of 1000, 2^20 and 2^22.
    assert one_rank.kernel_writes((1 << 20) + 7, 4) == 1 << 20
    for count in (1000, 1 << 20, 1 << 22):
        assert one_rank.kernel_writes(count, 4) == count
    assert one_rank.kernel_writes(0, 4) == 0
    counts = one_rank.cut_counts(2, 10)
    assert counts == one_rank.cut_counts(2, 10) == sorted(set(counts)) and len(counts) == 10
    assert all(count - 32 < one_rank.kernel_writes(count, 2) < count for count in counts)
    assert max(counts) * 2 < 3 << 20
