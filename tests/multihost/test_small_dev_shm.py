"""A /dev/shm too small for the shared-memory channels (Docker's default is 64 MiB): the job
must fail at init() on every rank naming /dev/shm and what to do. Its pages were reserved
lazily, and a rank died with SIGBUS at its first write past the free space, mid-collective,
printing nothing. Each job runs in a mount namespace of its own with a tiny /dev/shm."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess

import pytest

from tests.multihost.conftest import PYTHON, finish

RANK = """
import keras_ring, tensorflow as tf
keras_ring.init()
total = keras_ring.allreduce(tf.fill([1 << 18], 1.0), op=keras_ring.Sum)
print("sum", float(total[0]), flush=True)
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job_in_small_shm(env: dict, size: str, extra: dict) -> list[tuple[int, str, str]]:
    """Two ranks (environment rendezvous) sharing one private /dev/shm of ``size``."""
    missing = [tool for tool in ("unshare", "mount") if shutil.which(tool) is None]
    if missing or os.geteuid() != 0:
        pytest.fail(f"needs root and util-linux ({missing or 'not root'}), as CI has")
    env = dict(env, KERAS_RING_SIZE="2", KERAS_RING_RENDEZVOUS=f"127.0.0.1:{_port()}",
               KERAS_RING_TIMEOUT_SECONDS="60", **extra)
    # One shell in the namespace starts both ranks, so they share its /dev/shm; each rank's
    # output goes to its own file descriptor pair through the shell's redirections.
    script = ('mount -t tmpfs -o size="$SHM" tmpfs /dev/shm || exit 99; '
              'KERAS_RING_RANK=0 "$PY" -c "$RANK_SRC" >"$OUT0" 2>&1 & a=$!; '
              'KERAS_RING_RANK=1 "$PY" -c "$RANK_SRC" >"$OUT1" 2>&1 & b=$!; '
              'wait $a; ra=$?; wait $b; rb=$?; echo "$ra $rb"')
    outs = [f"/tmp/keras_ring_small_shm.{os.getpid()}.{r}" for r in range(2)]
    proc = subprocess.Popen(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script],
        env=dict(env, SHM=size, PY=PYTHON, RANK_SRC=RANK, OUT0=outs[0], OUT1=outs[1]),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    (code, out, err), = finish([proc])
    assert code == 0, f"the namespace's shell failed ({code}): {out}{err}"
    codes = [int(c) for c in out.split()]
    results = []
    for rank, path in enumerate(outs):
        with open(path) as f:
            results.append((codes[rank], f.read(), ""))
        os.unlink(path)
    return results


def test_a_dev_shm_too_small_fails_init_on_every_rank_naming_it(env):
    results = _job_in_small_shm(env, "1m", {})
    for rank, (code, output, _) in enumerate(results):
        assert code == 1, f"rank {rank} ended with {code} (135: SIGBUS):\n{output}"
        assert "/dev/shm has too little free space" in output, output
        assert "KERAS_RING_SHM=0" in output


def test_the_advice_works_tcp_in_the_same_small_dev_shm(env):
    for rank, (code, output, _) in enumerate(_job_in_small_shm(env, "1m",
                                                                {"KERAS_RING_SHM": "0"})):
        assert code == 0, f"rank {rank}:\n{output}"
        assert "sum 2.0" in output
