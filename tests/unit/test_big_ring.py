"""More than 2 GiB through the ring between 2 ranks, over shared memory and over TCP (the
world-of-one cases are in test_bad_input.py). About 2 GiB per rank."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = Path(__file__).with_name("big_ring_rank.py")
GUARD = 600  # seconds: a hang guard, never a timing assertion


@pytest.mark.parametrize("shm", ["1", "0"], ids=["shm", "tcp"])
def test_allreduce_over_2gib_between_two_ranks(mpirun, clean_env, shm):
    out = subprocess.run([mpirun, "-np", "2", sys.executable, str(CHILD)],
                         env=dict(clean_env, KERAS_RING_SHM=shm), capture_output=True,
                         text=True, timeout=GUARD)
    # Both ranks print to one pipe: a line may arrive split by the other's, so match the
    # records, not lines.
    results = re.findall(r"RESULT (\d+) (\d+) (\d+)", out.stdout)
    assert out.returncode == 0 and len(results) == 2, out.stdout + out.stderr[-3000:]
    for low, high, size in results:  # 1 + 2 everywhere, on both ranks
        assert (int(low), int(high), int(size)) == (3, 3, 2**31 + 16), results
