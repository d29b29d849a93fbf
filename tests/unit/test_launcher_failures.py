"""keras-ring-run when a job fails or is stopped: MPICH's shared memory, the messages and exit
codes, horovodrun's hostfile and slot checks.

As in test_launcher.py, the launcher runs as a script and the ranks are small programs
without TensorFlow, so these tests stay fast.
"""

import mmap
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from keras_ring import _mpich_shm

from tests.unit.conftest import ends_within, signal_a_thread_of
from tests.unit.launcher_support import GUARD, LAUNCHER, launch, run, rank_program


# Rank 1 fails only once rank 0 is inside MPI_Init, where it waits for rank 1 holding the
# segment MPICH has just made (its file appears in the private /dev/shm).
# Another job's segment appears too, made by a process of another session (not the rank's
# process group, whose segments its wrapper reports) and then held by nobody in sight (a
# container sharing /dev/shm): it is not this job's to remove.
_FAILS_WHILE_RANK_0_INITIALISES = """
    import glob, time
    if RANK == 0:
        from mpi4py import MPI
        signal.pause()
    while not glob.glob("/dev/shm/mpich_shm_*"):
        time.sleep(0.01)
    import subprocess  # out of the rank's process group, as another job's process is
    subprocess.run([sys.executable, "-c", "open('/dev/shm/mpich_shm_0th3rj0b_0', 'wb')"],
                   start_new_session=True, check=True)
    {failure}
"""
# MPI is up on both ranks when rank 1 leaves without finalising it: MPICH's mpirun kills
# rank 0 (its wrapper's whole process group) with SIGKILL.
_LEAVES_WITH_OS_EXIT = """
    from mpi4py import MPI
    MPI.COMM_WORLD.Barrier()
    if RANK == 1:
        os._exit(0)
    signal.pause()
"""


@pytest.mark.parametrize("shell", [False, True], ids=["program", "under-a-shell"])
@pytest.mark.parametrize("body, expected", [
    (_FAILS_WHILE_RANK_0_INITIALISES.format(failure="sys.exit(1)"), 1),
    (_FAILS_WHILE_RANK_0_INITIALISES.format(failure="os.kill(os.getpid(), signal.SIGKILL)"),
     137),
    (_LEAVES_WITH_OS_EXIT, None),
], ids=["exit-1", "sigkill", "mpirun-kills-with-sigkill"])
def test_a_stopped_job_leaves_no_mpich_segment_of_its_own_in_dev_shm(mpirun, clean_env,
                                                                   tmp_path, body, expected,
                                                                   shell):
    # Under a shell (a run script), the process that maps the segment is the wrapper's
    # grandchild: its segment went unreported and stayed.
    missing = [tool for tool in ("unshare", "mount") if shutil.which(tool) is None]
    if missing or os.geteuid() != 0:
        pytest.fail(f"needs root and util-linux ({missing or 'not root'}), as CI has")
    script = rank_program(tmp_path, body)
    rank = ["sh", "-c", '"$0" "$1"; exit $?', sys.executable, script] if shell else \
        [sys.executable, script]
    # The job runs in a private /dev/shm, so what is left there is its own.
    namespace = ('mount -t tmpfs tmpfs /dev/shm || exit 99; "$@"; echo "rc=$?"; '
                 'ls -A /dev/shm')
    proc = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", namespace, "sh",
         sys.executable, "-I", str(LAUNCHER), "--mpirun", mpirun, "-np", "2", *rank],
        env=clean_env, capture_output=True, timeout=GUARD)
    out, err = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 0, f"the namespace's shell failed ({proc.returncode}): {err}"
    tail = out[out.rindex("rc="):].split()
    code, left = int(tail[0][3:]), tail[1:]
    if expected is None:
        assert code != 0, err
    else:
        assert code == expected, err
    others = ["mpich_shm_0th3rj0b_0"] if "0th3rj0b" in body else []
    assert left == others, f"left in /dev/shm: {left}\n{err}"


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"  # a zombie is dead
    except FileNotFoundError:
        return True


# Rank 0 starts a helper (a server, a preprocessing daemon) that shares its stdout and shrugs
# off SIGTERM, and writes its pid for the test.
_STARTS_A_HELPER = """
    import subprocess, time
    PID_FILE = {pid_file!r}

    def wait_for(condition):
        while not condition():
            time.sleep(0.01)

    if RANK == 0:
        helper = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                                   "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                   "time.sleep(100000)"])
        with open(PID_FILE, "w") as f:
            f.write(str(helper.pid))
        {rank_0}
    else:
        {rank_1}
"""


@pytest.mark.parametrize("rank_0, rank_1, expected", [
    ("sys.exit(0)", "sys.exit(0)", 0),
    ("signal.signal(signal.SIGTERM, lambda *a: None); time.sleep(100000)",
     "wait_for(lambda: os.path.exists(PID_FILE)); sys.exit(3)", 3),
], ids=["rank-ends", "mpirun-kills-the-job"])
def test_what_a_rank_started_ends_with_it(mpirun, clean_env, tmp_path, rank_0, rank_1,
                                          expected):
    # The helper held the rank's stdout, so its report waited for the helper to end; and
    # where mpirun killed a failed job's wrappers, it lived on after the job.
    pid_file = tmp_path / "helper.pid"
    script = rank_program(tmp_path, _STARTS_A_HELPER.format(pid_file=str(pid_file),
                                                            rank_0=rank_0, rank_1=rank_1))
    code, _, err = run(mpirun, ["-np", "2", sys.executable, script], clean_env)
    assert code == expected, err
    helper = int(pid_file.read_text())
    deadline = time.monotonic() + GUARD  # its group's guard kills it as its wrapper dies
    while not _gone(helper) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(helper), f"the helper {helper} outlived the job"


def test_a_killed_wrapper_leaves_no_status_file_behind(mpirun, clean_env, tmp_path):
    # A rank that marked how it ended (here as a failure that followed another's) left its
    # status file in TMPDIR for good when mpirun killed its wrapper before it read it.
    temp = tmp_path / "tmp"
    temp.mkdir()
    marked = tmp_path / "marked"
    script = rank_program(tmp_path, f"""
        import time
        from keras_ring import _rank_wrapper
        if RANK == 0:
            _rank_wrapper.mark_follow_on()
            open({str(marked)!r}, "w").close()
            signal.signal(signal.SIGTERM, lambda *a: None)
            time.sleep(100000)
        while not os.path.exists({str(marked)!r}):
            time.sleep(0.01)
        sys.exit(3)
    """)
    code, _, err = run(mpirun, ["-np", "2", sys.executable, script],
                       dict(clean_env, TMPDIR=str(temp)))
    assert code == 3, err
    deadline = time.monotonic() + GUARD  # the guard removes it once the wrapper is gone
    while list(temp.glob("keras-ring-run-*.status")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not list(temp.glob("keras-ring-run-*.status")), err


def test_a_signal_a_rank_sends_its_own_group_leaves_the_rank_running(mpirun, clean_env,
                                                                     tmp_path):
    # The group's guard took any SIGUSR1 for its wrapper's death and killed the group: a
    # program that tells its workers to checkpoint with killpg (or a scheduler's signal
    # before preemption) lost the rank.
    script = rank_program(tmp_path, """
        import time
        got = []
        signal.signal(signal.SIGUSR1, lambda *a: got.append(1))

        def stat(pid):
            with open(f"/proc/{pid}/stat", "rb") as f:
                return f.read().rsplit(b")", 1)[1].split()

        def guard():  # the wrapper's other child in this rank's group
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    fields = stat(int(pid))
                except (FileNotFoundError, ProcessLookupError):
                    continue
                if (int(pid) != os.getpid() and int(fields[1]) == os.getppid()
                        and int(fields[2]) == os.getpgid(0)):
                    return int(pid)

        watched = guard()
        os.killpg(0, signal.SIGUSR1)
        # Until the guard is back at its pipe (a guard that takes the signal for its
        # wrapper's death kills this group instead).
        while not open(f"/proc/{watched}/wchan").read().endswith("pipe_read"):
            time.sleep(0.01)
        print(f"handled {len(got)}", flush=True)
    """)
    code, out, err = run(mpirun, ["-np", "2", sys.executable, script], clean_env)
    assert code == 0, err
    assert out.count("handled 1") == 2, out + err


def test_a_rank_killed_by_a_signal_is_named(mpirun, clean_env, tmp_path):
    # Only mpirun's banner said so, with the pid of the rank's wrapper.
    script = rank_program(tmp_path, """
        import time
        if RANK == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(100000)
    """)
    code, _, err = run(mpirun, ["-np", "2", sys.executable, script], clean_env)
    assert code == 137, err
    assert "keras-ring-run: rank 1 was killed by SIGKILL (exit code 137)" in err, err


def _rank_line(stream) -> bytes:
    """The next line a rank wrote (Hydra's mpiexec writes its own on Ctrl-C)."""
    while (line := stream.readline()).startswith(b"[mpiexec"):
        pass
    return line


@pytest.mark.parametrize("launcher", ["mpirun", "mpiexec.gforker"])
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)],
                         ids=["SIGTERM", "SIGINT"])
def test_a_stop_reaches_each_rank_once_and_a_second_one_waits_for_them(mpirun, clean_env,
                                                                     tmp_path, sig, code,
                                                                     launcher):
    # Hydra signals each rank's process group (so does Open MPI), gforker only the wrapper:
    # the wrapper passing Hydra's on as well ran a program's handler twice (a Ctrl-C's
    # KeyboardInterrupt inside its cleanup), and under gforker not passing it on left the
    # ranks to be killed after the grace period, their handlers never run. A
    # SIGTERM to the launcher's process group often arrives twice (``timeout`` passes its own
    # on): the second must not kill the ranks before they report, nor be mistaken for ranks
    # killed by mpirun.
    fifo = tmp_path / "go_on"
    os.mkfifo(fifo)
    script = rank_program(tmp_path, f"""
        def stop(signum, frame):
            print("stopping", flush=True)
            with open({str(fifo)!r}) as f:
                f.read()
            sys.exit({code})
        signal.signal({int(sig)}, stop)
        print("up", flush=True)
        signal.pause()
    """)
    mpirun = str(Path(mpirun).with_name(launcher))
    proc = subprocess.Popen([sys.executable, "-I", str(LAUNCHER), "--mpirun", mpirun, "-np",
                             "2", sys.executable, script], env=clean_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lines = [proc.stdout.readline() for _ in range(2)]  # blocks until both ranks are up
    assert sorted(lines) == [b"[0] up\n", b"[1] up\n"], lines
    proc.send_signal(sig)
    lines = [_rank_line(proc.stdout) for _ in range(2)]  # each rank got it once
    assert sorted(lines) == [b"[0] stopping\n", b"[1] stopping\n"], lines
    if sig == signal.SIGTERM:
        proc.send_signal(sig)
    with open(fifo, "w") as f:  # both ranks go on, and end
        f.write("go")
    out, err = proc.communicate(timeout=GUARD)
    assert b"stopping" not in out, out  # no rank's handler ran again
    assert proc.returncode == code, err
    assert (b"terminated by SIGTERM" in err) == (sig == signal.SIGTERM), err
    assert b"without an exit status" not in err, err


def test_a_failure_whose_cause_never_reports_keeps_its_own_exit_code(mpirun, clean_env,
                                                                    tmp_path):
    # Rank 0 fails because of a peer (as after a PeerFailureError), the peer never reports:
    # once the wait for its code ends, the stop's 143 must not pass for the job's cause (a
    # scheduler reads 143 as a pre-emption).
    wrapper_dir = Path(LAUNCHER).parent
    script = rank_program(tmp_path, f"""
        if RANK == 0:
            sys.path.insert(0, {str(wrapper_dir)!r})
            import _rank_wrapper
            _rank_wrapper.mark_follow_on()
            sys.exit(1)
        signal.pause()
    """)
    code, out, err = run(mpirun, ["-np", "2", sys.executable, script], clean_env)
    assert code == 1, err
    assert ("rank 0 failed because another rank had, and no rank reported a failure of its "
            "own within 10.0 s") in err, err
    assert "terminated by" not in err, err


def test_a_host_mpirun_cannot_reach_is_named_as_a_failed_launch(mpirun, clean_env, tmp_path):
    script = rank_program(tmp_path, "print('ran')\n")
    code, out, err = run(mpirun, ["-np", "2", "-H", "nosuchhost.invalid:2", sys.executable,
                                   script], clean_env)
    assert code != 0, (out, err)
    assert "2 of 2 ranks never started: mpirun could not launch them" in err, err
    assert "os._exit" not in err, err


@pytest.mark.parametrize("spelling", ["-hostfile", "--hostfile"])
def test_horovods_hostfile_names_the_hosts(mpirun, clean_env, tmp_path, spelling):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# this machine\nlocalhost slots=2\n\n")
    script = rank_program(tmp_path, "print('rank', RANK)\n")
    code, out, err = run(mpirun, ["-np", "2", spelling, str(hostfile), sys.executable,
                                   script], clean_env)
    assert code == 0, err
    assert sorted(out.splitlines()) == ["[0] rank 0", "[1] rank 1"]


@pytest.mark.parametrize("hosts, args, message", [
    ("localhost slots=2\nbadhost slots two\n", [],
     "line 2: expected 'hostname slots=N' (N at least 1), got 'badhost slots two'"),
    ("localhost slots=0\n", [], "line 1: expected 'hostname slots=N'"),
    ("\n# nothing\n", [], "names no host"),
    ("localhost slots=1\n", [], "-np 2 is more than the 1 slot(s) of --hostfile"),
    (None, ["-H", "localhost:1"], "-np 2 is more than the 1 slot(s) of -H localhost:1"),
    (None, ["-H", "a:1,b:x"], "expected host:slots entries (slots at least 1) separated by "
     "commas, got 'b:x'"),
    ("localhost slots=2\n", ["-H", "localhost:2"], "-H and --hostfile exclude each other"),
], ids=["malformed", "zero-slots", "empty", "np-over-hostfile", "np-over-H", "bad-H", "both"])
def test_host_errors_say_what_was_received(clean_env, tmp_path, hosts, args, message):
    if hosts is not None:
        (tmp_path / "hosts").write_text(hosts)
        args = [*args, "--hostfile", str(tmp_path / "hosts")]
    proc = subprocess.run([sys.executable, "-I", str(LAUNCHER), "-np", "2", *args,
                           "python", "x.py"], env=clean_env, capture_output=True,
                          timeout=GUARD)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr.decode(), proc.stderr


def test_only_the_jobs_segments_nobody_holds_made_since_it_began_are_removed(tmp_path):
    def segment(name: str) -> Path:
        path = tmp_path / name
        path.write_bytes(b"\0" * 4096)
        return path

    mapped, opened, orphan, others, renewed = (
        segment(f"mpich_shm_{n}_0") for n in ("mapped", "opened", "orphan", "others", "renewed"))
    other = segment("not_mpich_0")
    job = {(p.name, p.stat().st_ino) for p in (mapped, opened, orphan)}
    # Reported, but since replaced by a file of the same name (another job's world id).
    job.add((renewed.name, renewed.stat().st_ino + 1))
    job.add((other.name, other.stat().st_ino))  # not MPICH's, whatever is reported
    with open(mapped, "r+b") as f:
        mapping = mmap.mmap(f.fileno(), 4096)  # held by its mapping alone once f is closed
    held_open = os.open(opened, os.O_RDONLY)
    try:
        # Made before the job began: nothing is the job's.
        assert _mpich_shm.remove_orphans(time.time() + 3600, job, str(tmp_path)) == []
        assert _mpich_shm.remove_orphans(time.time() - 60, set(), str(tmp_path)) == []
        removed = _mpich_shm.remove_orphans(time.time() - 60, job, str(tmp_path))
    finally:
        mapping.close()
        os.close(held_open)
    assert removed == [str(orphan)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (mapped, opened, others, renewed, other))


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP], ids=["SIGKILL", "SIGHUP"])
def test_a_launcher_killed_or_hung_up_on_ends_every_rank(mpirun, clean_env, tmp_path, sig):
    # mpirun runs in a session of its own, so the launcher's end did not reach it: after a
    # SIGKILL (the OOM killer, kill -9) or a SIGHUP (its terminal or ssh session closed)
    # mpirun and every rank went on running, orphaned.
    script = rank_program(tmp_path, """
        print("up", os.getpid(), flush=True)
        signal.pause()
    """)
    proc = launch(mpirun, ["-np", "2", sys.executable, script], clean_env)
    pids = [int(proc.stdout.readline().split()[-1]) for _ in range(2)]
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=GUARD)
    left = [pid for pid in pids if not ends_within(pid, GUARD)]
    for pid in left:  # not to leave them to the tests after this one
        os.kill(pid, signal.SIGKILL)
    assert left == [], err
    if sig == signal.SIGHUP:
        assert proc.returncode == 128 + signal.SIGHUP, err
        assert b"terminated by SIGHUP" in err, err


@pytest.mark.parametrize("stdout", ["/dev/full", "closed"])
def test_output_that_cannot_be_written_stops_the_job_saying_so(mpirun, clean_env, tmp_path,
                                                               stdout):
    # The launcher's output thread died on the write error (ENOSPC; an AttributeError where
    # stdout was closed); nobody read mpirun's pipe any more, and the ranks, mpirun and the
    # launcher all waited for ever, the ranks blocked writing their output.
    # Both ranks say they are up before either floods stdout: the first write error stops
    # the job, and a rank not yet up would never name its pid.
    script = rank_program(tmp_path, f"""
        import time
        print("up", os.getpid(), file=sys.stderr, flush=True)
        open(os.path.join({str(tmp_path)!r}, f"up.{{RANK}}"), "w").close()
        while not all(os.path.exists(os.path.join({str(tmp_path)!r}, f"up.{{r}}"))
                      for r in (0, 1)):
            time.sleep(0.01)
        for i in range(20000):
            print("line", i)
        sys.stdout.flush()
        signal.pause()
    """)
    cmd = [sys.executable, "-I", str(LAUNCHER), "--mpirun", mpirun, "-np", "2",
           sys.executable, script]
    with open("/dev/full", "wb") as full:
        proc = subprocess.Popen(
            cmd, env=clean_env, stderr=subprocess.PIPE,
            stdout=full if stdout == "/dev/full" else subprocess.DEVNULL,
            preexec_fn=(lambda: os.close(1)) if stdout == "closed" else None)
    try:
        _, err = proc.communicate(timeout=GUARD)
    finally:
        if proc.poll() is None:
            proc.kill()  # mpirun learns of it, and stops the ranks
    err = err.decode()
    assert proc.returncode == 74, err
    assert "keras-ring-run: cannot write the job's output to its stdout: " in err, err
    pids = [int(line.split()[-1]) for line in err.splitlines() if " up " in line]
    assert len(pids) == 2, err
    assert all(ends_within(pid, GUARD) for pid in pids), err


def test_a_background_launcher_still_stops_the_job_on_sigint(mpirun, clean_env, tmp_path):
    # A shell starts a background job with SIGINT ignored; `kill -INT` must still stop it
    # (only SIGHUP's ignored disposition, nohup's, is kept).
    script = rank_program(tmp_path, """
        print("up", flush=True)
        signal.pause()
    """)
    proc = launch(mpirun, ["-np", "2", sys.executable, script], clean_env,
                  preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        assert [proc.stdout.readline().split()[-1] for _ in range(2)] == [b"up", b"up"]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=GUARD)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)],
                         ids=["SIGTERM", "SIGINT"])
def test_a_stop_that_the_kernel_hands_to_an_output_thread_still_stops_the_job(
        mpirun, clean_env, tmp_path, sig, code):
    # A signal to a process may land on any of its threads. The launcher's main thread
    # waited for mpirun in one long wait and ran its handler only when mpirun ended: a stop
    # that landed on a thread pumping the ranks' output never reached the ranks.
    script = rank_program(tmp_path, """
        print("up", flush=True)
        signal.pause()
    """)
    proc = launch(mpirun, ["-np", "2", sys.executable, script], clean_env)
    try:
        assert [proc.stdout.readline().split()[-1] for _ in range(2)] == [b"up", b"up"]
        signal_a_thread_of(proc.pid, sig)
        _, err = proc.communicate(timeout=GUARD)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, err


def test_a_launcher_under_nohup_lets_the_job_outlive_a_hangup(mpirun, clean_env, tmp_path):
    # nohup leaves SIGHUP ignored; the launcher installed its own handler over that, and a
    # closed terminal stopped a job its user had started under nohup (plain mpirun ran on).
    go_on = tmp_path / "go_on"
    script = rank_program(tmp_path, f"""
        import time
        print("up", flush=True)
        while not os.path.exists({str(go_on)!r}):
            time.sleep(0.01)
        print("done", flush=True)
    """)
    proc = launch(mpirun, ["-np", "2", sys.executable, script], clean_env,
                  preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    try:
        assert [proc.stdout.readline().split()[-1] for _ in range(2)] == [b"up", b"up"]
        proc.send_signal(signal.SIGHUP)
        go_on.touch()
        out, err = proc.communicate(timeout=GUARD)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert out.count(b"done") == 2, (out, err)
