"""mpirun and keras-ring-run across hosts, with no keras_ring variable set.

Each host's own name resolves to 127.0.1.1 there (as on Debian-like systems): a rank that
advertised "the address of its host name" could not be reached from the other host.
"""

from __future__ import annotations

import re
import subprocess

from tests.multihost.conftest import (PYTHON, ROOT, VENV_BIN, describe, finish, mpirun_argv,
                                      records)
from tests.multihost.netns import NS_EXEC

FIT = str(ROOT / "tests" / "multihost" / "fit_rank.py")


# The Keras modules whose checks and results depend on the world's size (averages, rates and
# weights compared across ranks, process sets, global batch statistics). The others never see
# the transport or the size; test-parallel runs them at 2 ranks.
KERAS_AT_FOUR = ("test_keras_equivalence.py", "test_keras_callbacks.py",
                 "test_keras_weight_check.py", "test_keras_process_sets.py",
                 "test_keras_sync_batch_norm.py")


def test_the_parallel_suite_passes_on_two_hosts_of_two_ranks(cluster, env):
    # Every collective, dtype and mode of tests/parallel, and the size-dependent Keras
    # modules, on rings where every message crosses a shared-memory link and a TCP link
    # between network stacks.
    c = cluster(["h0", "h1"])
    modules = sorted(str(m.relative_to(ROOT)) for m in (ROOT / "tests" / "parallel").glob("test_*")
                     if not m.name.startswith("test_keras_") or m.name in KERAS_AT_FOUR)
    assert len(modules) > len(KERAS_AT_FOUR) + 5, modules
    argv = mpirun_argv("h0,h1", 4, [PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                    *modules], ppn=2)
    # About 5 minutes on 2 cores (4 ranks, each test's TensorFlow work four times over).
    [(rc, out, err)] = finish([c.popen("h0", argv, env, cwd=ROOT, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)], guard=1200)
    summaries = re.findall(r"(\d+) passed[^\n]*? in [\d.]+s", out)  # ranks may share a line
    assert rc == 0 and len(summaries) == 4, describe([(rc, out, err)])
    assert len(set(summaries)) == 1 and int(summaries[0]) > 100, summaries
    assert not re.search(r"\b\d+ (failed|error)", out), out[-5000:]


def test_keras_fit_through_keras_ring_run_across_hosts_ends_with_identical_weights(cluster, env):
    c = cluster(["h0", "h1"])
    # keras-ring-run -H hands the hosts to Hydra, which reaches them with its launcher.
    env = dict(env, HYDRA_LAUNCHER="ssh", HYDRA_LAUNCHER_EXEC=str(NS_EXEC))
    argv = [str(VENV_BIN / "keras-ring-run"), "-np", "4", "-H", "h0:2,h1:2", PYTHON, FIT]
    [(rc, out, err)] = finish([c.popen("h0", argv, env, cwd=ROOT, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)])
    results = sorted(records(out, "RESULT"), key=lambda r: r["rank"])
    assert rc == 0 and len(results) == 4, describe([(rc, out, err)])
    assert [r["host"] for r in results] == ["h0", "h0", "h1", "h1"]
    assert all(r["local_size"] == 2 for r in results)
    assert len({r["weights"] for r in results}) == 1, results  # bitwise identical
    assert len({r["accuracy"] for r in results}) == 1  # averaged by MetricAverageCallback
    assert results[0]["accuracy"] > 0.8, results
