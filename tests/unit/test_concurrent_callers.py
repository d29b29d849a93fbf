"""Collectives of one name run by concurrent callers, checked on the job as a whole.

A ``tf.data`` map with ``num_parallel_calls`` runs its function for several elements at once,
so each rank submits the same-named collective for elements in an order of its own. Paired
by name and position they summed one rank's element 2 with another's element 3, silently
and differently on each rank. A rank that submits a name while another collective of that
name is still pending there now fails that collective on every rank. The outcome must be
the same on both ranks: all elements right, or that error; never a wrong element.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

GUARD = 300  # seconds: a hang guard for the job, never a timing assertion

PROGRAM = textwrap.dedent("""
    import tensorflow as tf
    import keras_ring as kr

    kr.init()
    rank = kr.rank()
    ds = tf.data.Dataset.range(32).map(
        lambda x: kr.allreduce(tf.cast(x, tf.float32) * (rank + 1), op=kr.Sum, name="feat"),
        num_parallel_calls=4)
    try:
        got = [float(v) for v in ds]
        outcome = "right" if got == [3.0 * i for i in range(32)] else f"WRONG {got}"
    except tf.errors.FailedPreconditionError as e:
        outcome = "error " + " ".join(str(e).split())
    print(f"OUTCOME {rank} {outcome}", flush=True)
""")


def test_a_parallel_map_of_one_named_collective_is_right_or_fails_on_every_rank(
        mpirun, clean_env, tmp_path):
    program = tmp_path / "parallel_map.py"
    program.write_text(PROGRAM)
    env = dict(clean_env, KERAS_RING_TIMEOUT_SECONDS="30", TF_CPP_MIN_LOG_LEVEL="3")
    job = subprocess.run([mpirun, "-np", "2", sys.executable, str(program)], env=env,
                         capture_output=True, text=True, timeout=GUARD)
    outcomes = dict(line.split(" ", 2)[1:] for line in job.stdout.splitlines()
                    if line.startswith("OUTCOME "))
    assert sorted(outcomes) == ["0", "1"], job.stdout + job.stderr
    kinds = {outcome.split(" ", 1)[0] for outcome in outcomes.values()}
    assert kinds in ({"right"}, {"error"}), outcomes
    for outcome in outcomes.values():
        if outcome.startswith("error"):
            assert ("allreduce 'feat (in tf.data map function)': rank" in outcome
                    and "submitted it while another collective of that name was still "
                        "pending there" in outcome
                    and "a tf.data map with num_parallel_calls" in outcome), outcome
