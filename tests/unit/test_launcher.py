"""keras-ring-run: rank prefixes, exit codes, a failing rank stops the job, Ctrl-C.

The launcher runs as a script (``python -I keras_ring/launcher.py``) and the ranks are small
programs: nothing loads TensorFlow, so these tests stay fast. One
test goes through the installed console script with a real keras_ring job.
"""

import os
import re
import select
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from keras_ring import _launch_output, launcher

from tests.unit.launcher_support import GUARD, LAUNCHER, launch, run, rank_program


def _wait_until_gone(pid: int) -> None:
    """Blocks until process ``pid`` has exited (a pidfd becomes readable then)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        ready, _, _ = select.select([fd], [], [], GUARD)
        assert ready, f"rank process {pid} still running {GUARD}s after the job ended"
    finally:
        os.close(fd)


def _pids(text: str) -> dict:
    return {int(line[1]): int(line.split()[-1]) for line in text.splitlines()
            if line.startswith("[") and " pid " in line}


def test_every_line_is_prefixed_with_its_rank(mpirun, clean_env, tmp_path):
    # Partial writes (one line in three pieces, unbuffered) must still give whole lines.
    script = rank_program(tmp_path, """
        for piece in (b"hello ", str(RANK).encode(), b" world\\nsecond line\\n"):
            os.write(1, piece)
        os.write(2, b"warning from %d\\n" % RANK)
        sys.stdout.write("no newline at the end")
    """)
    code, out, err = run(mpirun, ["-np", "2", sys.executable, script], clean_env)
    assert code == 0, err
    assert sorted(out.splitlines()) == sorted(
        f"[{r}] {text}" for r in range(2)
        for text in (f"hello {r} world", "second line", "no newline at the end"))
    assert {line for line in err.splitlines() if "warning" in line} == {
        "[0] warning from 0", "[1] warning from 1"}
    assert "KERAS_RING_RUN_EXIT" not in out + err


def test_a_failing_rank_stops_the_job_with_its_exit_code(mpirun, clean_env, tmp_path):
    fifo = tmp_path / "rank0_ready"
    os.mkfifo(fifo)
    # Rank 0 would run forever; rank 1 fails with 5 once rank 0 is surely running. Rank 0
    # is then terminated (exit 143, larger than 5): the job must still report 5, the first.
    script = rank_program(tmp_path, f"""
        if RANK == 0:
            print("pid", os.getpid(), flush=True)
            with open({str(fifo)!r}, "w") as f:
                f.write("ready")
            signal.pause()
        with open({str(fifo)!r}) as f:
            f.read()
        sys.exit(5)
    """)
    code, out, err = run(mpirun, ["-np", "2", sys.executable, script], clean_env)
    assert code == 5, (out, err)
    _wait_until_gone(_pids(out)[0])


def test_a_rank_killed_by_mpirun_without_a_word_fails_the_job(mpirun, clean_env, tmp_path):
    # A rank that started MPI and leaves with os._exit (a common way to skip a slow teardown)
    # makes MPICH's mpirun kill the others at once: they never report, and mpirun may exit 0.
    script = rank_program(tmp_path, """
        from mpi4py import MPI
        MPI.COMM_WORLD.Barrier()
        if RANK == 1:
            os._exit(0)
        signal.pause()
    """)
    code, out, err = run(mpirun, ["-np", "2", sys.executable, script], clean_env)
    assert code == 1, (out, err)
    assert "1 of 2 ranks ended without an exit status" in err, err


def test_exit_code_is_zero_when_every_rank_succeeds(mpirun, clean_env, tmp_path):
    script = rank_program(tmp_path, "print('done', RANK)\n")
    code, out, err = run(mpirun, ["-np", "3", sys.executable, script], clean_env)
    assert code == 0, err
    assert sorted(out.splitlines()) == ["[0] done 0", "[1] done 1", "[2] done 2"]


def _launcher_lines(proc: subprocess.Popen, count: int) -> list[str]:
    """The first ``count`` lines the launcher itself writes to stderr; fails after GUARD s."""
    fd, pending, lines = proc.stderr.fileno(), b"", []
    while len(lines) < count:
        ready, _, _ = select.select([fd], [], [], GUARD)
        assert ready, f"the launcher wrote {lines} in {GUARD} s, wanted {count} lines"
        chunk = os.read(fd, 65536)
        assert chunk, f"the launcher's stderr ended after {lines}"
        *whole, pending = (pending + chunk).split(b"\n")
        lines += [line.decode() for line in whole if line.startswith(b"keras-ring-run:")]
    return lines[:count]


def test_ranks_running_on_after_another_ended_are_named_while_the_job_waits(mpirun, clean_env,
                                                                             tmp_path):
    # Ranks 1 and 2 stay in their own code after rank 0 has ended (an atexit that never
    # returns, a save that takes an hour): the job waited for them without a word.
    fifos = [tmp_path / f"go_on_{rank}" for rank in (1, 2)]
    for fifo in fifos:
        os.mkfifo(fifo)
    script = rank_program(tmp_path, f"""
        if RANK > 0:
            with open({str(tmp_path)!r} + f"/go_on_{{RANK}}") as f:
                f.read()
    """)
    env = dict(clean_env, KERAS_RING_STALL_WARNING_SECONDS="2")
    proc = launch(mpirun, ["-np", "3", sys.executable, script], env)
    try:  # said again, at twice the wait: named more than once, never every second
        notices = _launcher_lines(proc, 2)
    except AssertionError:
        proc.terminate()  # the launcher stops its ranks
        proc.communicate(timeout=GUARD)
        raise
    for fifo in fifos:  # both go on, and end
        with open(fifo, "w") as f:
            f.write("go")
    out, err = proc.communicate(timeout=GUARD)
    assert proc.returncode == 0, err
    for notice in notices:
        assert re.match(r"keras-ring-run: rank 0 ended normally \d+ s ago; ranks 1, 2 not yet "
                        r"\(a rank's own code after its last collective", notice), notices
    seconds = [int(re.search(r"(\d+) s ago", n).group(1)) for n in notices]
    # 2 s, then 4 s later (at least 3 once each is rounded); a fixed interval gives 2.
    assert seconds[1] - seconds[0] >= 3, seconds


def test_ctrl_c_stops_every_rank(mpirun, clean_env, tmp_path):
    script = rank_program(tmp_path, """
        print("pid", os.getpid(), flush=True)
        signal.pause()
    """)
    proc = launch(mpirun, ["-np", "3", sys.executable, script], clean_env)
    lines = [proc.stdout.readline().decode() for _ in range(3)]  # blocks until all are up
    pids = _pids("".join(lines))
    assert sorted(pids) == [0, 1, 2], lines
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=GUARD)
    assert proc.returncode == 130
    for pid in pids.values():
        _wait_until_gone(pid)


def test_a_missing_program_fails_with_127(mpirun, clean_env, tmp_path):
    code, out, err = run(mpirun, ["-np", "2", str(tmp_path / "no_such_program")], clean_env)
    assert code == 127
    assert "cannot run" in err


@pytest.mark.parametrize("args, message", [
    (["-np", "2"], "no command given"),
    (["-np", "0", "python", "x.py"], "-np must be at least 1"),
    (["-np", "2", "--mpirun", "/nonexistent/mpirun", "python", "x.py"], "not an executable"),
])
def test_usage_errors_say_what_is_wrong(clean_env, args, message):
    proc = subprocess.run([sys.executable, "-I", str(LAUNCHER), *args], env=clean_env,
                          capture_output=True, timeout=GUARD)
    assert proc.returncode == 2
    assert message in proc.stderr.decode()


def test_finds_the_mpirun_next_to_this_python(mpirun):
    assert launcher.find_mpirun() == mpirun


def test_mpirun_command_per_flavour():
    hydra = launcher.mpirun_command("mpirun", "hydra", 4, "a:2,b:2", ["python", "t.py"])
    assert hydra[:5] == ["mpirun", "-np", "4", "-hosts", "a:2,b:2"]
    assert hydra[-4:] == [launcher._WRAPPER, "--", "python", "t.py"]
    ompi = launcher.mpirun_command("mpirun", "openmpi", 4, "a:2,b:2", ["python", "t.py"])
    assert "--oversubscribe" in ompi and ompi[ompi.index("-H") + 1] == "a:2,b:2"
    assert ompi[-4:] == [launcher._WRAPPER, "--", "python", "t.py"]


def test_console_script_runs_a_keras_ring_job(clean_env, tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import tensorflow as tf
        import keras_ring
        keras_ring.init()
        total = keras_ring.allreduce(tf.constant([keras_ring.rank() + 1.0]), op=keras_ring.Sum)
        print("size", keras_ring.size(), "sum", float(total[0]), flush=True)
    """))
    run = Path(sys.executable).parent / "keras-ring-run"
    proc = subprocess.run([str(run), "-np", "2", sys.executable, str(script)], env=clean_env,
                          capture_output=True, timeout=GUARD)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    lines = sorted(line for line in proc.stdout.decode().splitlines() if "sum" in line)
    assert lines == ["[0] size 2 sum 3.0", "[1] size 2 sum 3.0"]


def test_carriage_returns_reach_the_terminal_byte_for_byte(mpirun, clean_env, tmp_path):
    # A Keras progress bar: "\r" then the new state, no newline until the epoch ends.
    script = rank_program(tmp_path, """
        for piece in (b"Epoch 1/1", b"\\n", b"\\r 1/3 [==    ]", b"\\r 2/3 [====  ]",
                      b"\\r 3/3 [======]", b" - loss: 0.5\\n"):
            os.write(1, piece)
    """)
    code, out, err = run(mpirun, ["-np", "1", sys.executable, script], clean_env)
    assert code == 0, err
    assert out == ("[0] Epoch 1/1\n[0] \r[0]  1/3 [==    ]\r[0]  2/3 [====  ]"
                   "\r[0]  3/3 [======] - loss: 0.5\n")


def test_a_partial_line_is_forwarded_while_the_rank_still_runs(mpirun, clean_env, tmp_path):
    fifo = tmp_path / "go_on"
    os.mkfifo(fifo)
    script = rank_program(tmp_path, f"""
        os.write(1, b"\\r 1/3 [==    ]")  # no newline, and the rank waits before finishing
        with open({str(fifo)!r}) as f:
            f.read()
        os.write(1, b"\\n")
    """)
    proc = launch(mpirun, ["-np", "1", sys.executable, script], clean_env)
    seen = b""
    while not seen.endswith(b"[0]  1/3 [==    ]"):  # blocks until the bytes arrive
        piece = os.read(proc.stdout.fileno(), 100)
        assert piece, f"the launcher's output ended early: {seen!r}"
        seen += piece
    with open(fifo, "w") as f:  # only now may the rank end
        f.write("go")
    out, err = proc.communicate(timeout=GUARD)
    assert proc.returncode == 0, err
    assert seen + out == b"[0] \r[0]  1/3 [==    ]\n"


def test_frames_are_rendered_whatever_the_chunks_and_ranks_never_share_a_line():
    token = b"t0k"

    def frame(rank, data):
        return b"\x1eKR t0k %d 1 %d\n%s" % (rank, len(data), data)

    stream = (b"\x1eKR t0k 0 start\n" + frame(0, b"\r 1/3") + b"mpirun says hi\n"
              + frame(0, b"\r 2/3") + frame(1, b"warning\n") + frame(0, b"\r 3/3\n")
              + frame(1, b"\xff\x00 binary\n") + b"\x1eKR t0k 1 shm mpich_shm_1f_0 42\n"
              + b"\x1eKR t0k 1 exit 3\n"
              + b"\x1eKR other 9 1 3\nabc" + frame(0, b"tail") + b"\x1eKR t0k 0 exit 1 follows\n"
              + b"\x1eKR t0k 2 exit 0 stalled\n")
    for chunk_size in (1, 2, 7, len(stream)):  # frames split anywhere by the pipes
        written, exits, starts, segments = [], [], [], []

        class Sink:
            def write(self, data):
                written.append(data)

            def flush(self):
                pass

        reader = _launch_output.FrameReader(token, _launch_output.Renderer(Sink()),
                                            lambda *exit: exits.append(exit), starts.append,
                                            lambda *segment: segments.append(segment))
        for i in range(0, len(stream), chunk_size):
            reader.feed(stream[i:i + chunk_size])
        reader.close()
        assert b"".join(written) == (
            b"[0] \r[0]  1/3\nmpirun says hi\n[0] \r[0]  2/3\n[1] warning\n[0] \r[0]  3/3\n"
            b"[1] \xff\x00 binary\n\x1eKR other 9 1 3\nabc[0] tail\n"), chunk_size
        assert exits == [(1, 3, False, False), (0, 1, True, False), (2, 0, False, True)]
        assert starts == [0]
        assert segments == [("mpich_shm_1f_0", 42)]


def test_a_reader_that_stops_reading_ends_the_job_as_sigpipe_ends_mpirun(mpirun, clean_env,
                                                                        tmp_path):
    # `keras-ring-run ... | head -2`: the ranks print forever; once the reader has gone the
    # job must end (exit 141, as a shell reports SIGPIPE) and no rank may block writing.
    script = rank_program(tmp_path, f"""
        import itertools
        open({str(tmp_path)!r} + f"/pid{{RANK}}", "w").write(str(os.getpid()))
        for i in itertools.count():
            print("tick", i, flush=True)
    """)
    proc = launch(mpirun, ["-np", "2", sys.executable, script], clean_env)
    seen = set()
    while len(seen) < 2:  # both ranks have written their pid and print by now
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        seen.add(line[:3])
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
    proc.stdout.close()
    err = proc.stderr.read()  # ends when the launcher does
    proc.wait(timeout=GUARD)
    assert proc.returncode == 141, err
    assert b"without an exit status" not in err and b"Exception" not in err, err
    for pid in pids:
        _wait_until_gone(pid)


def test_stdin_reaches_rank_0_and_the_other_ranks_read_nothing(mpirun, clean_env, tmp_path):
    script = rank_program(tmp_path, "print(repr(sys.stdin.read()))\n")
    proc = launch(mpirun, ["-np", "2", sys.executable, script], clean_env,
                   stdin=subprocess.PIPE)
    out, err = proc.communicate(b"first\nsecond\n", timeout=GUARD)
    assert proc.returncode == 0, err
    assert sorted(out.decode().splitlines()) == ["[0] 'first\\nsecond\\n'", "[1] ''"]


def test_stdout_and_stderr_on_one_terminal_never_share_a_line():
    written = []

    class Sink:
        def __init__(self, name):
            self.name = name

        def write(self, data):
            written.append((self.name, data))

        def flush(self):
            pass

    screen = _launch_output.Screen()
    out = _launch_output.Renderer(Sink("out"), screen)
    err = _launch_output.Renderer(Sink("err"), screen)
    out.rank_output("0", b"\r 1/3")
    err.rank_output("1", b"warning\n")  # another rank's line on the other stream
    out.rank_output("0", b"\r 2/3")
    err.rank_output("0", b"its own warning\n")  # the same rank, the other stream
    out.rank_output("0", b"\r 3/3")
    out.close()
    err.close()
    assert written == [
        ("out", b"[0] \r[0]  1/3"), ("out", b"\n"), ("err", b"[1] warning\n"),
        ("out", b"[0] \r[0]  2/3"), ("out", b"\n"), ("err", b"[0] its own warning\n"),
        ("out", b"[0] \r[0]  3/3"), ("out", b"\n")]


def test_lines_stay_whole_under_heavy_output_from_every_rank(mpirun, clean_env, tmp_path):
    # Every write ends inside a line, without pause: a partial line must travel only once
    # its stream is quiet, else another rank's line lands inside it.
    script = rank_program(tmp_path, """
        blob = b"".join(b"%d %06d %s\\n" % (RANK, i, b"x" * 90) for i in range(30000))
        for start in range(0, len(blob), 4093):
            os.write(1, blob[start:start + 4093])
    """)
    code, out, err = run(mpirun, ["-np", "2", sys.executable, script], clean_env)
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 60000
    broken = [line for line in lines
              if not re.fullmatch(r"\[([01])\] \1 \d{6} x{90}", line)]
    assert not broken, broken[:5]
