"""The job as a whole: one rank stalls in user code, crashes, or raises, under plain mpirun,
keras-ring-run and the environment rendezvous (Spark: test_spark.py), or stops training alone. Every process must
end, in about the timeout plus the failure grace, and the surviving rank's error must name
the rank at fault.

Times: the faulting rank writes CLOCK_MONOTONIC at the fault; the test reads the same clock
when the last process has ended. The bounds leave 30 s for start-up noise and teardown on a
loaded 2-core machine; what they catch is a job that never ends (the stalled rank sleeps
600 s), not a slow one. The guard kills a hung job.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.unit import private_shm

CHILD = Path(__file__).with_name("job_child.py")
VENV_BIN = Path(sys.executable).parent
TIMEOUT = 10.0  # KERAS_RING_TIMEOUT_SECONDS in these jobs
GRACE = 5.0  # KERAS_RING_FAILURE_EXIT_SECONDS
MARGIN = 30.0
GUARD = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(launcher: str, env: dict, own_shm: bool = False) -> list[subprocess.Popen]:
    """Starts the job; ``own_shm``: mpirun in a /dev/shm of its own (``private_shm.py``)."""
    python = [sys.executable, str(CHILD)]
    opts = dict(env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if launcher == "mpirun":
        wrapper = private_shm.COMMAND if own_shm else []
        return [subprocess.Popen([*wrapper, str(VENV_BIN / "mpirun"), "-np", "2", *python],
                                 **opts)]
    if launcher == "keras-ring-run":
        return [subprocess.Popen([str(VENV_BIN / "keras-ring-run"), "-np", "2", *python], **opts)]
    rendezvous = f"127.0.0.1:{free_port()}"
    return [subprocess.Popen(python, **dict(opts, env=dict(
        env, KERAS_RING_RANK=str(r), KERAS_RING_SIZE="2", KERAS_RING_RENDEZVOUS=rendezvous)))
        for r in range(2)]


def run_job(launcher: str, fault: str, env: dict, job_dir: Path,
            own_shm: bool = False) -> tuple[float, str, list[int]]:
    """Seconds from the fault until every process of the job ended, their output, and the
    launchers' exit codes."""
    procs = launch(launcher, dict(env, FAULT=fault, JOB_DIR=str(job_dir),
                                  KERAS_RING_TIMEOUT_SECONDS=str(TIMEOUT),
                                  KERAS_RING_FAILURE_EXIT_SECONDS=str(GRACE),
                                  KERAS_RING_STALL_WARNING_SECONDS="3"), own_shm)
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=GUARD)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            _kill_ranks_of(job_dir)  # mpirun's proxy and a stopped rank outlive the launcher
            pytest.fail(f"{launcher}: the job with a rank that did '{fault}' was still running "
                        f"after {GUARD} s:\n" + "\n".join(p.communicate()[0][-3000:] for p in procs))
    ended = time.monotonic()
    text = "\n".join(outputs)
    fault_file = job_dir / "fault"
    assert fault_file.exists(), f"the fault never happened:\n{text[-5000:]}"
    return ended - float(fault_file.read_text()), text, [p.returncode for p in procs]


def _kill_ranks_of(job_dir: Path) -> None:
    """SIGKILLs every process whose environment names ``job_dir`` (the job's ranks)."""
    marker = f"JOB_DIR={job_dir}".encode()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


@pytest.fixture
def job_env(clean_env):
    return {k: v for k, v in clean_env.items() if not k.startswith("KERAS_RING_")}


@pytest.mark.parametrize("fault", ["stall", "crash", "raise"])
@pytest.mark.parametrize("launcher", ["mpirun", "keras-ring-run", "rendezvous"])
def test_one_faulty_rank_ends_the_whole_job(launcher, fault, job_env, tmp_path):
    took, output, _ = run_job(launcher, fault, job_env, tmp_path)
    # A stalled rank is found by rank 0's timeout; a crash or an error at once.
    bound = (TIMEOUT if fault == "stall" else 0.0) + GRACE + MARGIN
    assert took < bound, f"the job ended {took:.1f} s after the fault:\n{output[-5000:]}"
    error_file = tmp_path / "error.0"
    if fault == "crash" and not error_file.exists():
        # The launcher may stop rank 0 first (MPICH's and ours end a job whose rank failed).
        assert launcher != "rendezvous", output[-5000:]
        return
    assert error_file.exists(), f"rank 0's fit did not fail:\n{output[-5000:]}"
    error = json.loads(error_file.read_text())
    # Raised inside fit, yet keras_ring's class with the rank at fault as an attribute.
    expected = "CollectiveTimeoutError" if fault == "stall" else "PeerFailureError"
    assert error["type"] == expected and error["keras_ring"], error
    assert error["rank"] == 1 and error["collective"] is not None, error
    if fault == "raise":
        assert "rank 1 left with an error: ValueError: a bad record in the input" in error["message"]
    if fault == "stall" and launcher != "keras-ring-run":
        # Rank 1 never saw an error: keras_ring ended it, saying why (keras-ring-run stops
        # every rank itself as soon as rank 0 fails).
        assert "ending this process (exit code 70)" in output, output[-5000:]


@pytest.mark.parametrize("launcher, caught", [
    ("mpirun", None), ("keras-ring-run", None), ("mpirun", 0), ("keras-ring-run", 0),
    ("mpirun", 3)])
def test_a_rank_that_cannot_run_at_all_still_ends_with_the_job(launcher, caught, job_env,
                                                                tmp_path):
    # Under plain mpirun rank 0 failed on its timeout and exited, and mpirun waited for the
    # stopped rank for ever: a finished rank tells it nothing of a stopped peer. Where the
    # program caught the timeout and called sys.exit, so did both launchers.
    env = job_env if caught is None else dict(job_env, CATCH=str(caught))
    took, output, (code,) = run_job(launcher, "sigstop", env, tmp_path)
    assert took < TIMEOUT + GRACE + MARGIN, f"ended {took:.1f} s after the fault:\n{output[-5000:]}"
    error = json.loads((tmp_path / "error.0").read_text())
    assert error["type"] == "CollectiveTimeoutError" and error["rank"] == 1, error
    if "because its exit, after a peer did not take part in time" in output:
        # Interpreter teardown outlived the exit's own bound (about 1 job in 20 here: freeing
        # TensorFlow's dataset iterator waited on its threads): ended, saying so, with 70.
        assert code == 70, output[-5000:]
    elif caught is None:
        assert code != 0, output[-5000:]
    elif launcher == "mpirun":  # the program's own exit code, not the failure exit's
        assert code == caught, output[-5000:]
    else:
        assert code == 1 and "rank 0 ended normally after a peer did not take part" in output, (
            code, output[-5000:])


def test_a_rank_that_fails_before_init_ends_the_job_under_plain_mpirun(job_env, tmp_path):
    # Its peer waits inside MPI's start for a rank that never comes, where no Python runs,
    # and plain mpirun waits for that peer: keras_ring's bound must end it, saying why.
    segments = set(Path("/dev/shm").glob("mpich_shm_*"))
    took, output, _ = run_job("mpirun", "before_init", job_env, tmp_path, own_shm=True)
    assert took < TIMEOUT + MARGIN, f"the job ended {took:.1f} s after the fault:\n{output[-5000:]}"
    # MPICH's shared memory, which it removes only once every local rank has attached: in
    # the job's own /dev/shm where one could be made (root), else in the shared one.
    left = private_shm.leftovers(output)
    if left is not None:
        assert not left, f"the failed start left {left}"
    else:
        assert set(Path("/dev/shm").glob("mpich_shm_*")) <= segments, "the failed start left it"
    assert "this rank's data shard is missing" in output, output[-5000:]
    assert ("keras_ring: InitError on rank 0: not every rank reached keras_ring.init() within "
            "10 s") in output, output[-5000:]


def test_a_rank_killed_while_waiting_in_init_ends_the_job_at_once_under_plain_mpirun(
        job_env, tmp_path):
    # Its start-up watchdog must leave with it: one left behind held mpirun's output open
    # until the timeout (120 s here), then signalled a process id that may have been reused.
    proc = subprocess.Popen(
        [str(VENV_BIN / "mpirun"), "-np", "2", sys.executable, str(CHILD)],
        env=dict(job_env, FAULT="stall_before_init", JOB_DIR=str(tmp_path),
                 KERAS_RING_TIMEOUT_SECONDS="120"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        waiting = tmp_path / "waiting"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not _watchdog_of(waiting):
            time.sleep(0.2)  # polls for rank 0 inside init(), watched
        pid = _watchdog_of(waiting)
        assert pid, "rank 0 never waited in init() with its watchdog"
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        output = proc.communicate(timeout=GUARD)[0]
    finally:
        proc.kill()
    took = time.monotonic() - killed
    assert took < MARGIN, f"the job ended {took:.1f} s after rank 0 was killed:\n{output[-3000:]}"
    assert "not every rank reached" not in output, output[-3000:]


def _watchdog_of(pid_file: Path) -> int | None:
    """The process id in ``pid_file`` once a start-up watchdog watches that process."""
    if not pid_file.exists() or not pid_file.read_text():
        return None
    pid = pid_file.read_text()
    found = subprocess.run(["pgrep", "-f", f"keras_ring-watchdog [0-9.]+ {pid} "],
                           capture_output=True, text=True)
    return int(pid) if found.returncode == 0 else None


def test_a_rank_that_stops_training_alone_fails_with_its_peer_at_once_saying_why(job_env,
                                                                               tmp_path):
    # EarlyStopping or TerminateOnNaN deciding on one rank's own metrics: that rank's fit
    # ends and compares the rates one last time, while its peer is already in the next step.
    # Both fail there (before that last check, rank 1's program ended cleanly, exit 0).
    took, output, _ = run_job("mpirun", "stop", job_env, tmp_path)
    assert took < GRACE + MARGIN, f"the job ended {took:.1f} s after the stop:\n{output[-5000:]}"
    errors = []
    for rank in (0, 1):
        error_file = tmp_path / f"error.{rank}"
        assert error_file.exists(), f"rank {rank}'s fit did not fail:\n{output[-5000:]}"
        errors.append(json.loads(error_file.read_text()))
    for rank, error in enumerate(errors):
        # Rank 1 may find the mismatch, raise and leave before rank 0 has read its signature:
        # rank 0 then fails as its peer left, with rank 1's error (and so the cause) in its own.
        left = rank == 0 and error["type"] == "PeerFailureError"
        assert error["type"] == "CollectiveMismatchError" or left, error
        assert error["rank"] == 1, error
        assert not left or "rank 1 left with an error: " in error["message"], error
        assert "rank 1 has allgather 'keras_ring.rate_check.train_end'" in error["message"]
        assert "The fit ended on some ranks only, the others went on" in error["message"], error
    assert errors[0]["collective"].startswith("grouped_allreduce"), errors[0]  # in a step


# Rank 1 leaves with sys.exit(3) but ends last: its atexit handler, registered before init()
# and so run after keras_ring's (which tells rank 0 that rank 1 left), waits until rank 0,
# failing with PeerFailureError, has ended.
_CAUSE_ENDS_LAST = """
import atexit, os, sys, time
import numpy as np
import keras_ring as kr

peer = None

def wait_for_rank_0():
    deadline = time.monotonic() + 60
    while peer is not None and time.monotonic() < deadline:
        try:
            os.kill(peer, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)

atexit.register(wait_for_rank_0)
kr.init()
pid_of_rank_0 = int(kr.broadcast_object(os.getpid(), root_rank=0))
if kr.rank() == 1:
    peer = pid_of_rank_0
    kr.allreduce(np.ones(4, np.float32))
    sys.exit(3)
while True:
    kr.allreduce(np.ones(4, np.float32))
"""


def test_keras_ring_run_exits_with_the_code_of_the_rank_at_fault_whichever_ends_first(
        job_env, tmp_path):
    script = tmp_path / "cause_ends_last.py"
    script.write_text(_CAUSE_ENDS_LAST)
    proc = subprocess.run([str(VENV_BIN / "keras-ring-run"), "-np", "2", sys.executable,
                           str(script)], env=job_env, capture_output=True, text=True,
                          timeout=GUARD)
    out = proc.stdout + proc.stderr
    assert "[0] keras_ring.errors.PeerFailureError" in out, out[-5000:]
    assert proc.returncode == 3, out[-5000:]


def test_ctrl_c_ends_a_training_job_at_once_with_a_plain_keyboard_interrupt(job_env, tmp_path):
    # A terminal's Ctrl-C reaches the whole foreground process group.
    proc = subprocess.Popen(
        [str(VENV_BIN / "keras-ring-run"), "-np", "2", sys.executable, str(CHILD)],
        env=dict(job_env, JOB_DIR=str(tmp_path), EPOCHS="1000"), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, start_new_session=True)
    seen = b""
    while seen.count(b"TRAINING") < 2:  # both ranks are inside fit
        piece = os.read(proc.stdout.fileno(), 4096)
        assert piece, seen.decode(errors="replace")[-3000:]
        seen += piece
    interrupted = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    try:
        output = (seen + proc.communicate(timeout=GUARD)[0]).decode(errors="replace")
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the interrupted job did not end")
    took = time.monotonic() - interrupted
    assert proc.returncode == 130, output[-3000:]
    # Well before the launcher's 15 s grace ends in SIGKILL (about half a second here).
    assert took < 10, (took, output[-3000:])
    assert "MISMATCH" not in output and "[0] KeyboardInterrupt" in output, output[-3000:]


_PREEMPTION_AWARE = """
import os, signal, sys
import tensorflow as tf
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))  # before init(), as such programs do
import keras_ring as kr
kr.init()
for step in range(10000):
    if kr.rank() == 0 and step == 20:
        os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's notice, to one rank
    if kr.allreduce(tf.constant([float(bool(stop))]), op=kr.Max, name="stop")[0] > 0:
        break
final = kr.allreduce(tf.constant([1.0]), op=kr.Sum, name="final")
sys.stdout.write(f"STOPPED {kr.rank()} {step} {final[0]:.0f}\\n")  # one write: ranks share stdout
"""


def test_a_program_that_handles_sigterm_itself_stops_together_in_good_order(job_env):
    # Its handler decides what SIGTERM means: keras_ring must not fail its collectives.
    proc = subprocess.run([str(VENV_BIN / "mpirun"), "-np", "2", sys.executable, "-c",
                           _PREEMPTION_AWARE], env=dict(job_env, KERAS_RING_TIMEOUT_SECONDS="60"),
                          capture_output=True, text=True, timeout=GUARD)
    stopped = sorted(line for line in proc.stdout.splitlines() if line.startswith("STOPPED"))
    assert proc.returncode == 0 and stopped == ["STOPPED 0 20 2", "STOPPED 1 20 2"], (
        proc.stdout[-2000:] + proc.stderr[-3000:])


_SHUTDOWN_UNDER_A_WAITING_THREAD = """
import os, sys, threading, time
from pathlib import Path
import tensorflow as tf
import keras_ring as kr
kr.init()
flag = Path(sys.argv[1])
if kr.rank() == 1:
    log = Path(sys.argv[1] + ".stderr")
    os.dup2(os.open(log, os.O_WRONLY | os.O_CREAT), 2)  # the runtime's stall warnings

    def background():
        try:
            kr.allreduce(tf.ones([4]), op=kr.Sum, name="bg")
        except kr.KerasRingError as e:
            sys.stdout.write(f"BG {type(e).__name__}: {e}\\n")
    thread = threading.Thread(target=background)
    thread.start()
    while "has waited 1 s in allreduce 'bg'" not in log.read_text():
        time.sleep(0.05)  # until the runtime says the thread waits in it
    kr.shutdown()  # while the thread waits for rank 0, which never joins 'bg'
    thread.join()
    flag.write_text("down")
    time.sleep(float(sys.argv[2]))  # the program goes on working, past the failure grace
    sys.stdout.write("RANK1 DONE\\n")
else:
    while not flag.exists():
        time.sleep(0.05)
    try:
        kr.allreduce(tf.ones([4]), name="other")
    except kr.KerasRingError as e:
        sys.stdout.write(f"RANK0 {type(e).__name__}: {e}\\n")
"""


def test_shutdown_while_another_thread_waits_in_a_collective_fails_no_process(job_env, tmp_path):
    # The stop cut the waiting collective short, and that was taken for a failure of the
    # job: the process armed its failure exit and ended itself with 70 while it went on
    # working, and its peer could hear "aborted, which gave up" instead of the shutdown.
    proc = subprocess.run([str(VENV_BIN / "mpirun"), "-np", "2", sys.executable, "-c",
                           _SHUTDOWN_UNDER_A_WAITING_THREAD, str(tmp_path / "down"),
                           str(GRACE + 3)],
                          env=dict(job_env, KERAS_RING_TIMEOUT_SECONDS="60",
                                   KERAS_RING_STALL_WARNING_SECONDS="1"),
                          capture_output=True, text=True, timeout=GUARD)
    out = proc.stdout + proc.stderr[-3000:] + (tmp_path / "down.stderr").read_text()[-3000:]
    assert proc.returncode == 0 and "RANK1 DONE" in proc.stdout, out
    assert ("BG CollectiveAbortedError: keras_ring: allreduce 'bg' failed on rank 1: this rank "
            "shut keras_ring down (keras_ring.shutdown(), on another thread") in proc.stdout, out
    assert "RANK0 PeerFailureError" in proc.stdout and "rank 1 has shut down" in proc.stdout, out
    assert "allreduce 'bg'" in proc.stdout.split("RANK0", 1)[1] and "gave up" not in out, out


def test_peers_hear_the_cause_of_an_error_that_tensorflow_wrapped():
    # What a rank's uncaught error tells its peers: the Python error raised in a tf.data
    # generator, or the failing op's message, not TensorFlow's "Graph execution error:".
    import keras
    import tensorflow as tf

    from keras_ring.runtime import _gist

    def records():
        yield tf.ones((2, 4)), tf.ones((2, 1))
        raise ValueError("a bad record in the input")

    spec = (tf.TensorSpec((2, 4)), tf.TensorSpec((2, 1)))
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    causes = []
    for data in (tf.data.Dataset.from_generator(records, output_signature=spec),
                 tf.data.Dataset.from_tensor_slices((tf.ones((4, 5)), tf.ones((4, 1)))).batch(2)):
        with pytest.raises(tf.errors.OpError) as raised:
            model.fit(data, verbose=0)
        assert str(raised.value).startswith("Graph execution error:")
        causes.append(_gist(raised.value))
    assert causes[0] == "ValueError: a bad record in the input", causes
    assert causes[1].startswith("Matrix size-incompatible: In[0]: [2,5]"), causes

    @tf.function
    def add(a, b):
        return a + b

    with pytest.raises(ValueError) as raised:  # raised while tracing
        add(tf.ones((2, 3)), tf.ones((4, 3)))
    assert _gist(raised.value).startswith("ValueError: Dimensions must be equal"), str(raised.value)
    assert _gist(RuntimeError("first line\nsecond")) == "first line"
