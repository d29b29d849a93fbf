"""KERAS_RING_TIMELINE writes a valid, complete Chrome trace: one row per rank, every
collective with its phases and byte counts, on one clock across hosts; events beyond those the
runtime holds go to a temp file and still reach the trace, also where a peer is gone."""

import json
import shutil
import subprocess
import sys

SCRIPT = """
import tensorflow as tf, keras_ring as kr
kr.init()
for i in range(3):
    kr.allreduce(tf.ones([100_000]), name=f"grad{i}")      # ring path
    kr.allgather(tf.ones([kr.rank() + 1, 2]), name=f"g{i}")  # completes in the exchange
    kr.broadcast(tf.ones([5]), root_rank=0)
kr.shutdown()
"""


def test_timeline_is_valid_and_complete(tmp_path, mpirun, clean_env):
    path = tmp_path / "trace.json"
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = dict(clean_env, KERAS_RING_TIMELINE=str(path))
    # Rank 1's monotonic clock runs a day ahead (a time namespace), as another host's would
    # stand apart by its own boot time.
    assert shutil.which("unshare"), "needs util-linux's unshare, as CI has"
    ahead = ["unshare", "--time", "--fork", "--monotonic", "86400"]
    proc = subprocess.run([mpirun, "-np", "1", sys.executable, str(script), ":", "-np", "1",
                           *ahead, sys.executable, str(script)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = json.loads(path.read_text())["traceEvents"]
    rows = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert rows == {0: "rank 0", 1: "rank 1"}
    for rank in (0, 1):
        mine = [e for e in events if e["tid"] == rank and e["ph"] in ("X", "i")]
        seqs = sorted({e["args"]["seq"] for e in mine})
        assert seqs == list(range(1, 10)), seqs  # 9 collectives, none missing
        for seq in seqs:
            phases = {e["name"]: e for e in mine if e["args"]["seq"] == seq}
            assert set(phases) == {"queued", "waiting for peers", "transfer/reduce", "done"}
            q, w, t = phases["queued"], phases["waiting for peers"], phases["transfer/reduce"]
            assert q["ts"] <= w["ts"] <= t["ts"] <= phases["done"]["ts"]
            assert min(q["dur"], w["dur"], t["dur"]) >= 0
        by_label = {e["args"]["collective"]: e["args"] for e in mine if e["name"] == "done"}
        assert by_label["allreduce 'grad0'"]["bytes"] == 400_000
        assert not by_label["allreduce 'grad0'"]["completed_in_exchange"]
        assert by_label["allgather 'g0'"]["bytes"] == (rank + 1) * 2 * 4
        assert by_label["allgather 'g0'"]["completed_in_exchange"]
        assert all(a["ok"] for a in by_label.values())
    # One collective ends at about the same moment on both rows.
    done = {(e["tid"], e["args"]["seq"]): e["ts"] for e in events if e["name"] == "done"}
    apart = max(abs(done[0, seq] - done[1, seq]) for seq in range(1, 10)) / 1e6
    assert apart < 60, f"rank 1's row is {apart:.0f} s away from rank 0's"


SPILLING = """
import os, tempfile, tensorflow as tf, keras_ring as kr
if os.environ.get("NO_TEMP"):
    tempfile.tempdir = "/nonexistent-keras-ring-tmp"  # a full or read-only temp directory
if os.environ.get("PMI_RANK") == os.environ.get("NO_TIMELINE"):
    del os.environ["KERAS_RING_TIMELINE"]  # shuts down at once: the others cannot gather
kr.init()
for i in range(60):
    kr.allreduce(tf.ones([10]), name=f"a{i}")
    kr.timeline.mark(tf.ones([1]), f"m{i}")
if os.environ.get("RAISE") == str(kr.rank()):
    raise RuntimeError("boom on this rank")  # the others wait in the next allreduce
if os.environ.get("RAISE"):
    kr.allreduce(tf.ones([10]), name="after")
with open(os.environ["SPILLED_PREFIX"] + str(kr.rank()), "w") as f:  # stdout interleaves
    f.write(str(kr.timeline.SPILL.bytes))
kr.shutdown()
"""


def _run_spilling(tmp_path, mpirun, clean_env, **env):
    script = tmp_path / "job.py"
    script.write_text(SPILLING)
    env = dict(clean_env, KERAS_RING_TIMELINE=str(tmp_path / "trace.json"),
               KERAS_RING_TIMELINE_MEMORY_EVENTS="7", SPILLED_PREFIX=str(tmp_path / "spilled."),
               **env)
    return subprocess.run([mpirun, "-np", "2", sys.executable, str(script)], env=env,
                          capture_output=True, text=True, timeout=300)


def _check_complete(events, rank):
    done = sorted(e["args"]["seq"] for e in events if e["tid"] == rank and e["name"] == "done")
    marks = sorted(e["name"] for e in events if e["tid"] == rank and e.get("cat") == "mark")
    assert done == list(range(1, 61)), done  # each once: spilled (7 at a time) and held
    assert marks == sorted(f"m{i}" for i in range(60)), marks


def test_events_spilled_to_a_temp_file_all_reach_the_trace(tmp_path, mpirun, clean_env):
    proc = _run_spilling(tmp_path, mpirun, clean_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    spilled = [int((tmp_path / f"spilled.{rank}").read_text()) for rank in (0, 1)]
    # 119 of each rank's 120 events (whole sevens) spilled, some 65 bytes each: not held.
    assert min(spilled) > 50 * 119, spilled
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    for rank in (0, 1):
        _check_complete(events, rank)


def test_where_the_ranks_cannot_gather_rank_0_writes_its_own_spilled_events(tmp_path, mpirun,
                                                                           clean_env):
    proc = _run_spilling(tmp_path, mpirun, clean_env, NO_TIMELINE="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (tmp_path / "trace.json").exists()
    events = json.loads((tmp_path / "trace.rank0.json").read_text())["traceEvents"]
    _check_complete(events, 0)
    assert {e["tid"] for e in events} == {0}


def test_without_a_temp_directory_the_events_stay_in_memory_and_still_reach_the_trace(
        tmp_path, mpirun, clean_env):
    proc = _run_spilling(tmp_path, mpirun, clean_env, NO_TEMP="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no file for the events in the temp directory" in proc.stderr, proc.stderr[-3000:]
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    for rank in (0, 1):
        _check_complete(events, rank)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "job.py", "spilled.0", "spilled.1", "trace.json"]  # rank 0's gathering file is gone


def test_a_rank_leaving_with_an_error_gathers_nothing_and_its_peers_hear_the_error(
        tmp_path, mpirun, clean_env):
    # Its shutdown's gathering met the peers' allreduce: they reported an operation
    # mismatch with the timeline's collective instead of this rank's error.
    proc = _run_spilling(tmp_path, mpirun, clean_env, RAISE="1")
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "rank 1 left with an error: RuntimeError: boom on this rank" in out, out[-4000:]
    assert "mismatch" not in out, out[-4000:]
    assert not (tmp_path / "trace.json").exists()
    for rank in (0, 1):  # each rank's own events, none lost
        events = json.loads((tmp_path / f"trace.rank{rank}.json").read_text())["traceEvents"]
        _check_complete(events, rank)
