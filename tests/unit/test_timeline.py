"""KERAS_RING_TIMELINE writes a valid, complete Chrome trace: one row per rank, every
collective with its phases and byte counts, on one clock across hosts."""

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
