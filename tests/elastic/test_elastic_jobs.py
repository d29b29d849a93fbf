"""Elastic jobs end to end: ``keras-ring-run --min-np/--max-np/--host-discovery-script``
starting real workers (tests/elastic/train_worker.py, a Keras ``fit`` with the three elastic
callbacks), killing one, growing, blacklisting and falling below ``--min-np``.

Hosts other than localhost are names only: ``fake_ssh`` runs their workers on this machine
with their own host identity, so they talk TCP to the others as separate machines would
(tests/multihost runs the same across network namespaces). Every job is judged whole: the
launcher must end with every worker, and every worker's records are checked.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
RUN = Path(sys.executable).parent / "keras-ring-run"
GUARD = 600  # seconds a job may take before it counts as hung


def run_job(tmp_path: Path, hosts: list[str], args: list[str], worker: str = "train_worker.py",
            **env_extra: str):
    """Runs an elastic job of ``worker``; (exit code, output, records by kind)."""
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text("".join(h + "\n" for h in hosts))
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts_file}\n")
    discover.chmod(0o755)
    marker = uuid.uuid4().hex  # finds this job's processes afterwards
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "OMPI_", "HYDRA_", "MPI_", "KERAS_RING_"))}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(ROOT), KERAS_RING_TIMEOUT_SECONDS="120",
               KERAS_RING_ELASTIC_JOIN_SECONDS="60", KR_MARKER=marker, **env_extra)
    env = {k: v.replace("{hosts}", str(hosts_file)) for k, v in env.items()}
    cmd = [str(RUN), "--host-discovery-script", str(discover), "--remote-shell",
           str(HERE / "fake_ssh"), *args, sys.executable, str(HERE / worker), marker]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=GUARD)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the elastic job was still running after {GUARD} s:\n{out[-6000:]}")
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    assert not left.strip(), f"worker processes outlived the job: {left}\n{out[-4000:]}"
    return proc.returncode, out, _records(out)


def _records(out: str) -> dict[str, list[dict]]:
    found: dict[str, list[dict]] = {}
    for m in re.finditer(r"^\[(?P<worker>[^\]]+)\] (?P<kind>[A-Z]+) (?P<json>\{.*\})$", out,
                         re.M):
        found.setdefault(m["kind"], []).append(dict(json.loads(m["json"]),
                                                    worker=m["worker"]))
    return found


def _no_shared_memory_left(records: dict[str, list[dict]]) -> None:
    pids = {r["pid"] for kind in records.values() for r in kind}
    left = [n for n in os.listdir("/dev/shm") if any(n.endswith(f".{p}") for p in pids)]
    assert not left, f"shared-memory regions of the job's workers remain: {left}"


def _worlds(records: dict[str, list[dict]]) -> list[int]:
    """The sizes of the worlds the job trained in, in order (from each world's first batch,
    which every rank of it records)."""
    sizes: list[int] = []
    for r in sorted(records.get("RESET", []), key=lambda r: r["time"]):
        if r["rank"] == 0:
            sizes.append(r["size"])
    return sizes


def test_a_killed_worker_leaves_then_a_new_host_brings_the_world_back(tmp_path):
    # localhost:2 share memory, hostC talks TCP; hostC's worker dies mid-epoch 1, the two
    # go on from the last commit, rank 0 then adds hostD to the discovery file: world of 3.
    code, out, records = run_job(
        tmp_path, ["localhost:2", "hostC:1"],
        ["-np", "3", "--min-np", "2", "--max-np", "3", "--blacklist-after", "1"],
        KR_DIE_ON_HOST="hostC", KR_DIE_AT="1:5", KR_EPOCHS="6",
        KR_GROW_FILE="{hosts}", KR_GROW_LINE="hostD:1",
        KERAS_RING_TIMELINE=str(tmp_path / "trace.json"))
    assert code == 0, out[-6000:]
    assert "host hostC blacklisted after 1 failed worker(s)" in out
    # Each world wrote its own trace (the broken one each survivor's): none overwrote another.
    traces = sorted(p.name for p in tmp_path.glob("trace*.json"))
    assert len({re.match(r"trace\.world(\d+)\.", n)[1] for n in traces}) == 3, traces
    assert len(records["DEATH"]) == 1, out[-6000:]
    assert _worlds(records) == [3, 2, 3], (records["RESET"], out[-6000:])
    # Two resets later, in a world of the same size, a survivor holds what it held in the
    # first: no thread, descriptor or socket of an old world is left.
    for pid in {r["pid"] for r in records["RESET"] if r["size"] == 2}:
        mine = [r for r in records["RESET"] if r["pid"] == pid]
        first, last = mine[0], mine[-1]
        assert (last["threads"], last["fds"], last["sockets"]) == (
            first["threads"], first["fds"], first["sockets"]), mine
    results = records["RESULT"]
    assert sorted(r["host"] for r in results) == ["hostD", "localhost", "localhost"], results
    assert len({r["checksum"] for r in results}) == 1, results  # identical weights
    assert all(r["epoch"] == 6 for r in results), results
    # Time from the death to the first batch of the world of two, as each survivor saw it.
    death = records["DEATH"][0]["time"]
    resumed = [r["time"] - death for r in records["RESET"] if r["size"] == 2]
    assert len(resumed) == 2, records["RESET"]
    print(f"failure to first step of the new world: {max(resumed):.2f} s")
    _no_shared_memory_left(records)


@pytest.mark.parametrize("retrace", ["1", "0"], ids=["retraced", "as-horovod-writes-it"])
def test_a_custom_loop_with_tensorflow_state_goes_on_after_a_death(tmp_path, retrace):
    # Horovod's TensorFlow 2 elastic shape: a tf.function step with DistributedGradientTape,
    # commits every 5 steps. The worker that dies shares memory with a survivor (localhost.1
    # and .2 are started first, in that order); localhost is not blacklisted after one
    # failure, so a replacement (localhost.4) joins. Horovod's example does not trace the
    # step again: the newcomer's first trace then compared weights and measured buckets,
    # collectives the survivors' step never ran (a mismatch on every rank).
    code, out, records = run_job(
        tmp_path, ["localhost:2", "hostC:1"],
        ["-np", "3", "--min-np", "2", "--max-np", "3", "--blacklist-after", "2"],
        worker="custom_loop_worker.py", KR_DIE_WORKER="localhost.2", KR_DIE_AT_STEP="23",
        KR_WAIT_NEWCOMER="1", KR_RETRACE=retrace)
    assert code == 0, out[-6000:]
    assert len(records["DEATH"]) == 1, out[-6000:]
    results = records["RESULT"]
    assert sorted(r["worker"] for r in results) == ["hostC.3", "localhost.1", "localhost.4"]
    assert [r["size"] for r in results] == [3, 3, 3], results
    assert len({r["checksum"] for r in results}) == 1, results
    assert all(r["step"] == 60 and r["loss"] < 0.05 for r in results), results
    _no_shared_memory_left(records)


@pytest.mark.parametrize("error", ["KR_RAISE_AT_STEP", "KR_MISMATCH_AT_STEP"])
def test_an_error_of_the_program_ends_the_job(tmp_path, error):
    # The workers exited, their host was blacklisted, and the job waited out its elastic
    # timeout (600 s by default) for workers to come back; with a more lenient blacklist it
    # started fresh workers that trained from step 0 into the same error.
    code, out, records = run_job(
        tmp_path, ["localhost:2"], ["-np", "2", "--min-np", "1", "--max-np", "2"],
        worker="custom_loop_worker.py", KERAS_RING_ELASTIC_TIMEOUT_SECONDS="3600",
        **{error: "7"})
    assert code == 1, out[-6000:]
    expected = ("every worker of the last world (2) exited with an error"
                if error == "KR_RAISE_AT_STEP" else
                "failed with an error of the program, which every world would meet again: "
                "CollectiveMismatchError")
    assert expected in out, out[-6000:]
    assert "RESULT" not in records


def test_a_newcomer_s_step_before_elastic_run_ends_the_job_saying_where_to_move_it(tmp_path):
    # Horovod's tensorflow2_synthetic_benchmark_elastic.py trains one batch before
    # elastic.run. A replacement does too, in a world whose survivors are syncing state:
    # under Horovod both sides wait for ever; here a mismatch that says what to change.
    code, out, records = run_job(
        tmp_path, ["localhost:2"], ["-np", "2", "--min-np", "1", "--max-np", "2"],
        worker="custom_loop_worker.py", KR_DIE_WORKER="localhost.1", KR_DIE_AT_STEP="13",
        KR_STEP_BEFORE_RUN="1")
    assert code == 1, out[-6000:]
    assert len(records["DEATH"]) == 1 and "RESULT" not in records, out[-6000:]
    assert "an error of the program, which every world would meet again" in out, out[-6000:]
    assert "began keras_ring.elastic.run's state sync (a worker joined or left)" in out, \
        out[-6000:]
    assert "optimizer.build(model.trainable_variables)" in out, out[-6000:]


def test_an_uninterrupted_job_reaches_the_same_accuracy_band(tmp_path):
    # The same training without faults, at a fixed world of 3: the elastic job above must
    # land in the same band (the killed run loses part of an epoch and runs some at 2).
    # Its workers first fit one step apart, as Horovod's elastic example does.
    code, out, records = run_job(tmp_path, ["localhost:3"],
                                 ["-np", "3", "--min-np", "3", "--max-np", "3"],
                                 KR_EPOCHS="6", KR_FIT_FIRST="1")
    assert code == 0, out[-6000:]
    plain = records["RESULT"]
    assert len(plain) == 3 and len({r["checksum"] for r in plain}) == 1, plain
    assert plain[0]["accuracy"] > 0.85, plain
    code, out, records = run_job(
        tmp_path, ["localhost:2", "hostC:1"],
        ["-np", "3", "--min-np", "2", "--max-np", "3", "--blacklist-after", "1"],
        KR_DIE_ON_HOST="hostC", KR_DIE_AT="2:7", KR_EPOCHS="6")
    assert code == 0, out[-6000:]
    elastic = records["RESULT"]
    assert len(elastic) == 2 and len({r["checksum"] for r in elastic}) == 1, elastic
    assert abs(elastic[0]["accuracy"] - plain[0]["accuracy"]) <= 0.05, (elastic, plain)


def test_a_host_whose_workers_keep_failing_is_blacklisted(tmp_path):
    # hostBad's workers exit at once: started as newcomers, they fail twice, then the host
    # gets no more; the job finishes with the two good workers.
    code, out, records = run_job(
        tmp_path, ["localhost:2", "hostBad:1"],
        ["-np", "2", "--min-np", "2", "--max-np", "3", "--blacklist-after", "2"],
        KR_FAIL_ON_HOST="hostBad", KR_EPOCHS="3")
    assert code == 0, out[-6000:]
    assert "host hostBad blacklisted after 2 failed worker(s)" in out, out[-6000:]
    assert out.count("on hostBad exited with 3") == 2, out[-6000:]
    results = records["RESULT"]
    assert len(results) == 2 and len({r["checksum"] for r in results}) == 1, results


def test_below_min_np_the_job_fails_clearly_within_its_bound(tmp_path):
    code, out, records = run_job(
        tmp_path, ["localhost:1", "hostC:1"],
        ["-np", "2", "--min-np", "2", "--max-np", "2", "--blacklist-after", "1"],
        KR_DIE_ON_HOST="hostC", KR_DIE_AT="1:3", KR_EPOCHS="4",
        KERAS_RING_ELASTIC_TIMEOUT_SECONDS="5")
    assert code != 0, out[-6000:]
    assert "fewer than --min-np 2" in out, out[-6000:]
    assert "RESULT" not in records


@pytest.mark.parametrize("args, message", [
    (["--min-np", "2"], "needs --max-np, --host-discovery-script too"),
    (["--min-np", "3", "--max-np", "2", "--host-discovery-script", "x"],
     "need 1 <= --min-np <= -np <= --max-np"),
    (["-np", "5", "--min-np", "1", "--max-np", "4", "--host-discovery-script", "x"],
     "need 1 <= --min-np <= -np <= --max-np"),
])
def test_elastic_arguments_are_checked(args, message):
    proc = subprocess.run([str(RUN), *args, "python", "t.py"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert message in proc.stderr, proc.stderr


def test_a_scheduler_drives_the_rendezvous_without_the_launcher(tmp_path):
    # `python -m keras_ring.elastic.server` alone; the test plays the scheduler that starts
    # the workers (with the environment rendezvous variables) and restarts nobody.
    server = subprocess.Popen([sys.executable, "-m", "keras_ring.elastic.server", "--port", "0",
                               "--min-np", "2", "--max-np", "3", "-np", "3", "--secret", "k8s"],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        port = int(re.search(r"on port (\d+)", server.stdout.readline())[1])
        env = {k: v for k, v in os.environ.items() if not k.startswith(
            ("PMI_", "PMIX_", "OMPI_", "HYDRA_", "MPI_", "KERAS_RING_"))}
        env.update(TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(ROOT), KR_EPOCHS="4",
                   KERAS_RING_TIMEOUT_SECONDS="120", KR_DIE_ON_HOST="pod2", KR_DIE_AT="1:2",
                   KERAS_RING_ELASTIC_RENDEZVOUS=f"127.0.0.1:{port}",
                   KERAS_RING_ELASTIC_SECRET="k8s")
        workers = [subprocess.Popen([sys.executable, str(HERE / "train_worker.py")],
                                    env=dict(env, KERAS_RING_HOST_ID=f"pod{i}",
                                             KERAS_RING_ELASTIC_WORKER=f"pod{i}"),
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                   for i in range(3)]
        outs = [w.communicate(timeout=GUARD)[0] for w in workers]
    finally:
        server.kill()
        server.wait()
    assert [w.returncode for w in workers] == [0, 0, -signal.SIGKILL], outs
    results = [json.loads(re.search(r"^RESULT (\{.*\})$", out, re.M)[1]) for out in outs[:2]]
    assert [r["size"] for r in results] == [2, 2], results
    assert results[0]["checksum"] == results[1]["checksum"], results


@pytest.mark.parametrize("sig, code, said", [
    (signal.SIGINT, 130, "interrupted: stopping every worker"),
    (signal.SIGTERM, 143, "terminated by SIGTERM: stopping every worker"),  # was 130
], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_or_sigterm_stops_every_worker(tmp_path, sig, code, said):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    marker = uuid.uuid4().hex
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(ROOT), KR_EPOCHS="1000")
    proc = subprocess.Popen([str(RUN), "-np", "2", "--min-np", "2", "--max-np", "2",
                             "--host-discovery-script", str(discover), sys.executable,
                             str(HERE / "train_worker.py"), marker],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in proc.stdout:  # wait until both workers train, then press Ctrl-C
        seen.append(line)
        if sum("RESET" in s for s in seen) == 2:
            proc.send_signal(sig)
            break
    out = "".join(seen) + proc.communicate(timeout=GUARD)[0]
    assert proc.returncode == code, out[-4000:]
    assert said in out
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    assert not left.strip(), left


def test_a_slow_discovery_script_neither_holds_the_job_nor_outlives_it(tmp_path):
    # The driver waited for each run of the script: a job whose workers had finished ended
    # only at the script's 30 s timeout, and what the script started was left running.
    hosts, flag = tmp_path / "hosts", tmp_path / "flag"
    hosts.write_text("localhost:2\n")
    marker = uuid.uuid4().hex
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\nif [ -f {flag} ]; then sh -c 'sleep 600' slow-{marker}; fi"
                        f"\ntouch {flag}\ncat {hosts}\n")
    discover.chmod(0o755)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(ROOT), KR_EPOCHS="2")
    proc = subprocess.run([str(RUN), "-np", "2", "--min-np", "2", "--max-np", "2",
                           "--host-discovery-script", str(discover), sys.executable,
                           str(HERE / "train_worker.py"), marker],
                          env=env, capture_output=True, text=True, timeout=GUARD)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert flag.exists()  # the script ran, and its later runs hung
    left = subprocess.run(["pgrep", "-f", f"slow-{marker}"], capture_output=True, text=True)
    assert not left.stdout.strip(), left.stdout
