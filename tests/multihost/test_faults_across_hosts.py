"""Faults in a training job that spans hosts: a rank killed, a cable pulled. Every process
must end, each surviving rank with an error that names a rank on the failed side, within
the timeout (plus start-up and exit), and no shared memory may be left behind."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from pathlib import Path

from tests.multihost.conftest import PYTHON, ROOT, describe, finish, records

FIT = str(ROOT / "tests" / "multihost" / "fit_rank.py")
PLACEMENT = ["h0", "h0", "h1", "h1"]
PORT = 29612
TIMEOUT = 15.0
# A survivor exits by itself (1, its uncaught error) or, if that takes longer than the failure
# grace on a loaded machine, keras_ring ends it (70): either way the process ended.
ENDED = (1, 70)


def start(c, env: dict, extra: list[str]) -> list[subprocess.Popen]:
    procs = []
    for rank, host in enumerate(PLACEMENT):
        child = dict(env, KERAS_RING_RANK=str(rank), KERAS_RING_SIZE=str(len(PLACEMENT)),
                     KERAS_RING_RENDEZVOUS=f"h0:{PORT}", KERAS_RING_TIMEOUT_SECONDS=str(TIMEOUT),
                     KERAS_RING_STALL_WARNING_SECONDS="5")
        procs.append(c.popen(host, [PYTHON, FIT, "--epochs", "50", *extra], child, cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def named_rank(message: str) -> set[int]:
    """Every rank a message names: "rank 3", or a list such as "ranks not yet heard from: 2, 3"."""
    named = {int(r) for r in re.findall(r"\brank (\d+)\b", message)}
    for listed in re.findall(r"\branks [a-z ]*:? ?(\d+(?:, \d+)*)", message):
        named |= {int(r) for r in listed.split(", ")}
    return named


def segments_left(outputs: list[tuple[int, str, str]]) -> list[str]:
    """The job's shared-memory segments still in /dev/shm. A segment's name ends in its
    owner's process id (keras_ring.TOKEN.RANK.PID), so jobs of other tests running beside
    this one (the suite runs on two pytest-xdist workers) are not mistaken for a leak."""
    pids = {r["pid"] for _, out, _ in outputs for r in records(out, "START")}
    assert len(pids) == len(PLACEMENT), describe(outputs)  # else the check would see nothing
    return [p.name for p in Path("/dev/shm").glob("keras_ring.*")
            if p.name.rpartition(".")[2].isdigit() and int(p.name.rpartition(".")[2]) in pids]


def test_a_rank_killed_mid_training_ends_the_job_with_errors_naming_it(cluster, env):
    c = cluster(["h0", "h1"])
    outputs = finish(start(c, env, ["--die-at-step", "5", "--die-rank", "3"]))
    assert outputs[3][0] == -9, describe(outputs)  # the crash itself
    for rank in (0, 1, 2):
        rc, out, _ = outputs[rank]
        errors = records(out, "ERROR")
        assert rc in ENDED and len(errors) == 1, describe(outputs)
        assert 3 in named_rank(errors[0]["message"]), errors[0]
    assert segments_left(outputs) == []


def test_a_pulled_cable_ends_every_process_on_both_sides_within_the_timeout(cluster, env):
    c = cluster(["h0", "h1"])
    procs = start(c, env, [])
    pulled, read = {}, []

    def pull_when_training():  # after a few steps on rank 0, cut h1 off the bridge
        for line in procs[0].stdout:
            read.append(line)
            if line.startswith("STEP 5"):
                c.link_down("h1")
                pulled["at"] = time.monotonic()
                break

    watcher = threading.Thread(target=pull_when_training)
    watcher.start()
    watcher.join(300)
    assert "at" in pulled, "training never reached step 5"
    outputs = finish(procs)
    ended = time.monotonic() - pulled["at"]
    rc, out, err = outputs[0]
    outputs[0] = (rc, "".join(read) + out, err)  # with what the watcher read
    # Each side waits at most the timeout for the other, then every process exits.
    assert ended < 3 * TIMEOUT + 30, ended
    for rank, (rc, out, err) in enumerate(outputs):
        errors = records(out, "ERROR")
        assert rc in ENDED and len(errors) == 1, describe(outputs)
        other_side = {2, 3} if PLACEMENT[rank] == "h0" else {0, 1}
        assert named_rank(errors[0]["message"]) & other_side, (rank, errors[0])
    assert segments_left(outputs) == []
