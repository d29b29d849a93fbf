"""Elastic jobs across hosts made of network namespaces: keras-ring-run runs on h0 and starts
the workers of h1 and h2 through ns_exec (standing in for ssh). A worker killed on h2, and
h2's cable pulled (a lost host: no error reaches anyone, the survivors time out and the
rendezvous drops the silent worker): the two survivors go on from the last commit and end
with identical weights; the launcher ends with every worker."""

from __future__ import annotations

import json
import re
import subprocess
import threading

from tests.multihost.conftest import PYTHON, ROOT, VENV_BIN
from tests.multihost.netns import NS_EXEC

WORKER = ROOT / "tests" / "elastic" / "train_worker.py"
GUARD = 600


def start(c, env: dict, tmp_path, hosts: list[str], **extra: str) -> subprocess.Popen:
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text("".join(h + "\n" for h in hosts))
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts_file}\n")
    discover.chmod(0o755)
    env = dict(env, KERAS_RING_TIMEOUT_SECONDS="10", KERAS_RING_ELASTIC_JOIN_SECONDS="10",
               KERAS_RING_START_TIMEOUT_SECONDS="120", **extra)
    cmd = [str(VENV_BIN / "keras-ring-run"), "-np", "3", "--min-np", "2", "--max-np", "3",
           "--blacklist-after", "1", "--host-discovery-script", str(discover),
           "--remote-shell", f"{NS_EXEC} -x", PYTHON, str(WORKER)]
    return c.popen("h0", cmd, env, cwd=ROOT, stdout=subprocess.PIPE,
                   stderr=subprocess.STDOUT, text=True)


def records(out: str, kind: str) -> list[dict]:
    return [dict(json.loads(m[2]), worker=m[1]) for m in
            re.finditer(rf"^\[([^\]]+)\] {kind} (\{{.*\}})$", out, re.M)]


def check_survivors(out: str) -> None:
    results = records(out, "RESULT")
    assert sorted(r["host"] for r in results) == ["h0", "h1"], out[-6000:]
    assert len({r["checksum"] for r in results}) == 1, results  # identical weights
    assert all(r["size"] == 2 and r["epoch"] == 6 for r in results), results


def test_a_worker_killed_on_another_host_leaves_the_others_training(cluster, env, tmp_path):
    c = cluster(["h0", "h1", "h2"])
    proc = start(c, env, tmp_path, ["h0:1", "h1:1", "h2:1"], KR_DIE_ON_HOST="h2",
                 KR_DIE_AT="1:4", KR_EPOCHS="6")
    out, _ = proc.communicate(timeout=GUARD)
    assert proc.returncode == 0, out[-6000:]
    assert "host h2 blacklisted" in out, out[-6000:]
    check_survivors(out)


def test_a_lost_host_is_dropped_and_the_others_go_on(cluster, env, tmp_path):
    c = cluster(["h0", "h1", "h2"])
    proc = start(c, env, tmp_path, ["h0:1", "h1:1", "h2:1"], KR_EPOCHS="6")
    lines: list[str] = []

    def pull_after_first_epoch():
        pulled = False
        for line in proc.stdout:
            lines.append(line)
            if not pulled and re.match(r"^\[h0\.\d+\] EPOCH \{\"epoch\": 0", line):
                c.link_down("h2")  # h2's worker hears nothing: it stalls, it does not fail
                pulled = True

    reader = threading.Thread(target=pull_after_first_epoch)
    reader.start()
    reader.join(GUARD)
    assert not reader.is_alive(), "the job was still running at the guard"
    proc.wait(timeout=60)
    out = "".join(lines)
    assert proc.returncode == 0, out[-6000:]
    assert re.search(r"worker h2\.\d+ did not rejoin in time", out), out[-6000:]
    check_survivors(out)
