"""Fault injection under mpirun: a rank dies, stalls, diverges, runs an extra step, or the
job is interrupted. Every rank must end with an error that names what went wrong, within a
bound, and nothing of the job may stay in /dev/shm.

Each test starts one small job of ``fault_child.py`` (one scenario per job). Ranks print one
parseable line per event (see that file); times come from the children's CLOCK_MONOTONIC, so
every bound is measured from the fault to the error, never as wall-clock time of the test.
Under ``-disable-auto-cleanup`` the launcher does not tear the job down when a rank dies, so
the survivors must notice on their own. Each rank runs inside ``sh -c`` that reports its real
exit status (``EXIT rank=R code=C``, 128+N for signal N). That wrapper also matters for what
is tested: Hydra (MPICH 5) still SIGKILLs the other ranks when one is *killed by a signal*,
even under -disable-auto-cleanup, while a rank that *exits* only earns them a SIGUSR1 (which
the ranks survive; the shell traps it). Through the wrapper a rank's death is an exit status
to Hydra, so the survivors are left alone, as under launchers that never clean up.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.unit import private_shm

CHILD = Path(__file__).with_name("fault_child.py")
GUARD = 150  # seconds: a hang guard per job, never a timing assertion
SHM = Path("/dev/shm")
# Runs `python fault_child.py ARGS` and reports how it ended: 128+N means killed by signal N.
WRAPPER = 'trap "true" USR1; "$0" "$@"; echo "EXIT rank=$PMI_RANK code=$?"'
TRANSPORTS = {"shm": "1", "tcp": "0"}
# Exit codes of the faulting rank for each way of dying.
DEATH_CODE = {"sigkill": 128 + signal.SIGKILL, "exit": 7, "segv": 128 + signal.SIGSEGV}

_RESULT = re.compile(
    r"^RESULT rank=(?P<rank>\d+) case=(?P<case>\S+) outcome=(?P<outcome>\w+) "
    r"error=(?P<error>\w+) peer=(?P<peer>\S+) t=(?P<t>[\d.]+) dt=(?P<dt>[\d.]+) "
    r"coll=(?P<coll>.*?) msg=(?P<msg>.*)$")
_FIELDS = re.compile(r"(\w+)=(\S+)")


@dataclass
class Result:
    rank: int
    case: str
    outcome: str
    error: str
    peer: int | None
    t: float
    dt: float
    coll: str
    msg: str


@dataclass
class Job:
    returncode: int
    stdout: str
    stderr: str
    ready: dict = field(default_factory=dict)    # rank -> pid
    faults: dict = field(default_factory=dict)   # rank -> monotonic time of the fault
    exits: dict = field(default_factory=dict)    # rank -> exit status (128+N: signal N)
    done: dict = field(default_factory=dict)     # rank -> the status its program exits with
    results: dict = field(default_factory=dict)  # (rank, case) -> Result

    def result(self, rank: int, case: str) -> Result:
        key = (rank, case)
        assert key in self.results, f"rank {rank} reported nothing for {case!r}\n{self.log()}"
        return self.results[key]

    def log(self) -> str:
        err = "\n".join(line for line in self.stderr.splitlines()
                        if "keras_ring" in line or "Error" in line or "error" in line)
        crash = self.stderr.find("Fatal Python error")  # faulthandler's stacks, whole
        stacks = f"\n--- crash\n{self.stderr[crash:crash + 6000]}" if crash >= 0 else ""
        return f"--- stdout\n{self.stdout}\n--- stderr (filtered)\n{err}{stacks}"


def parse(job: Job) -> Job:
    for line in job.stdout.splitlines():
        m = _RESULT.match(line)
        if m:
            r = Result(int(m["rank"]), m["case"], m["outcome"], m["error"],
                       None if m["peer"] == "None" else int(m["peer"]), float(m["t"]),
                       float(m["dt"]), m["coll"], m["msg"])
            job.results[(r.rank, r.case)] = r
            continue
        kind, _, rest = line.partition(" ")
        fields = dict(_FIELDS.findall(rest))
        if kind == "READY":
            job.ready[int(fields["rank"])] = int(fields["pid"])
        elif kind == "FAULT":
            job.faults[int(fields["rank"])] = float(fields["t"])
        elif kind == "EXIT":
            job.exits[int(fields["rank"])] = int(fields["code"])
        elif kind == "DONE":
            job.done[int(fields["rank"])] = int(fields["code"])
    return job


def _left_with(job: Job, rank: int, code: int) -> bool:
    """Whether ``rank``'s program ended with ``code``. A rank whose peer stalled has mpirun end
    the job with its status (PMI's abort), which may stop the wrappers before they report
    exit statuses: then the program's own last word and mpirun's status must both say it."""
    if rank in job.exits:
        return job.exits[rank] == code
    return job.done.get(rank) == code and job.returncode == code


def _shm_names() -> set[str]:
    return {n for n in os.listdir(SHM) if n.startswith(("keras_ring.", "mpich"))}


def _wait_gone(pids, seconds: float) -> list[int]:
    """Waits up to ``seconds`` for every pid to exit; returns those still running."""
    deadline = time.monotonic() + seconds
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _running(p)]
        if alive:
            time.sleep(0.05)
    return alive


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except (FileNotFoundError, ProcessLookupError):  # gone before, or while, we read it
        return False


def _kill_everything(proc: subprocess.Popen, pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # our own session: mpirun and its proxy
    except ProcessLookupError:
        pass


def _in_use(name: str) -> bool:
    """Whether a live process maps /dev/shm/``name`` (another job running on this machine)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                if f"/dev/shm/{name}" in f.read():
                    return True
        except OSError:
            pass
    return False


def _check_clean(before: set[str], job: Job) -> None:
    """Nothing of the job in /dev/shm: no keras_ring segment, no new MPICH file.

    The job ran in a /dev/shm of its own (``private_shm.py``), so whatever it left there is
    its own, whatever ran beside it. Where that could not be made (not root), in the shared
    one: every process of the job has ended by now, so a new file that a live process still
    maps belongs to another job on this machine; one that nobody maps was left behind.
    """
    left = private_shm.leftovers(job.stdout)
    if left is not None:
        assert not left, f"left in /dev/shm: {left}\n{job.log()}"
        return
    leftover = {n for n in _shm_names() - before if not _in_use(n)}
    ours = {n for n in os.listdir(SHM) if n.startswith("keras_ring.")
            and n.rsplit(".", 1)[-1] in {str(p) for p in job.ready.values()}}
    assert not leftover | ours, f"left in /dev/shm: {sorted(leftover | ours)}\n{job.log()}"


def _env(clean_env, transport: str, timeout: float) -> dict:
    env = dict(clean_env)
    # PYTHONFAULTHANDLER: a rank that crashes prints every thread's stack (one rank's
    # SIGSEGV after a forwarded Ctrl-C, seen twice, was TensorFlow's: see training_loop).
    env.update(KERAS_RING_TIMEOUT_SECONDS=str(timeout), KERAS_RING_STALL_WARNING_SECONDS="1",
               KERAS_RING_SHM=TRANSPORTS[transport], PYTHONUNBUFFERED="1",
               PYTHONFAULTHANDLER="1")
    return env


def _run_job(mpirun, clean_env, np_: int, scenario: str, fault_rank: int, transport: str,
             timeout: float, auto_cleanup: bool = False) -> Job:
    before = _shm_names()
    cmd = [*private_shm.COMMAND, mpirun, *([] if auto_cleanup else ["-disable-auto-cleanup"]),
           "-np", str(np_), "sh", "-c", WRAPPER, sys.executable, str(CHILD), scenario,
           str(fault_rank)]
    proc = subprocess.Popen(cmd, env=_env(clean_env, transport, timeout), cwd=CHILD.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=GUARD)
    except subprocess.TimeoutExpired:
        _kill_everything(proc, [])
        out, err = proc.communicate()
        job = parse(Job(-1, out, err))
        _kill_everything(proc, job.ready.values())
        raise AssertionError(f"job hung for {GUARD} s\n{job.log()}") from None
    job = parse(Job(proc.returncode, out, err))
    alive = _wait_gone(job.ready.values(), 10)
    if alive:
        _kill_everything(proc, alive)
        raise AssertionError(f"rank processes {alive} outlived mpirun\n{job.log()}")
    assert sorted(job.ready) == list(range(np_)), job.log()
    _check_clean(before, job)
    return job


_JOBS: dict = {}


def run_job(mpirun, clean_env, *args, **kwargs) -> Job:
    """Runs a job once per module: tests that check different things of one run share it."""
    key = (args, tuple(sorted(kwargs.items())))
    if key not in _JOBS:
        try:
            _JOBS[key] = _run_job(mpirun, clean_env, *args, **kwargs)
        except AssertionError as e:
            _JOBS[key] = e
    if isinstance(_JOBS[key], AssertionError):
        raise _JOBS[key]
    return _JOBS[key]


def _timing(label: str, bound: float, times) -> None:
    # Shown with -s or -rA; the table in the project notes comes from these lines.
    print(f"\nTIMING {label}: bound {bound:.1f} s, measured "
          + ", ".join(f"rank {r}: {t:.3f} s" for r, t in sorted(times.items())))


def _assert_names(res: Result, rank: int, collective_labels, job: Job) -> None:
    """The error names the rank it is about and the collective."""
    assert res.peer == rank, f"rank {res.rank} blames rank {res.peer}, not rank {rank}: {res.msg}\n{job.log()}"
    assert f"rank {rank}" in res.msg, res.msg
    assert any(label in res.msg for label in collective_labels), res.msg


# --- a rank dies ----------------------------------------------------------------------

DEATHS = [
    pytest.param(2, "shm", "sigkill", 1, id="np2-shm-sigkill"),
    pytest.param(2, "shm", "segv", 1, id="np2-shm-segv"),
    pytest.param(2, "tcp", "segv", 0, id="np2-tcp-segv-rank0"),
    pytest.param(4, "shm", "sigkill", 2, id="np4-shm-sigkill"),
    pytest.param(4, "tcp", "exit", 2, id="np4-tcp-exit"),
]
DEATH_TIMEOUT = 20.0
# Death is observable directly (EOF, the shm peer's liveness socket, the watchdog): well
# before the timeout, which is the contract's upper bound. Half of it is a margin a loaded
# 2-core machine passes (typical: tens of milliseconds, printed as TIMING with -s).
DEATH_BOUND = DEATH_TIMEOUT / 2


@pytest.mark.parametrize("np_,transport,how,dead", DEATHS)
def test_dead_rank_fails_every_survivor(mpirun, clean_env, np_, transport, how, dead):
    job = run_job(mpirun, clean_env, np_, f"kill-{how}", dead, transport, DEATH_TIMEOUT)
    assert job.exits.get(dead) == DEATH_CODE[how], job.log()
    fault = job.faults[dead]
    times = {}
    for r in range(np_):
        if r == dead:
            continue
        assert job.exits.get(r) == 3, f"rank {r} exit {job.exits.get(r)}\n{job.log()}"
        res = job.result(r, "loop")
        assert res.outcome == "error" and res.error == "PeerFailureError", res
        assert res.coll in ("allreduce 'grad'", "allreduce 'loss'"), res
        times[r] = res.t - fault
        # Every later collective fails at once too, naming itself.
        later = job.result(r, "later")
        assert later.error == "PeerFailureError" and later.dt < DEATH_BOUND, later
        assert later.coll == "allreduce 'after_failure'", later
    _timing(f"dead rank np={np_} {transport} {how}", DEATH_BOUND, times)
    assert all(0 <= t <= DEATH_BOUND for t in times.values()), (times, job.log())


@pytest.mark.parametrize("np_,transport,how,dead", DEATHS)
def test_every_survivor_names_the_dead_rank(mpirun, clean_env, np_, transport, how, dead):
    """Not only the dead rank's neighbours: every survivor must say which rank died."""
    job = run_job(mpirun, clean_env, np_, f"kill-{how}", dead, transport, DEATH_TIMEOUT)
    problems = []
    for r in range(np_):
        if r == dead:
            continue
        for case, labels in (("loop", ["allreduce 'grad'", "allreduce 'loss'"]),
                             ("later", ["allreduce 'after_failure'"])):
            try:
                _assert_names(job.result(r, case), dead, labels, job)
            except AssertionError as e:
                problems.append(str(e).split("\n")[0])
    assert not problems, "\n".join(problems)


def test_dead_rank_under_default_launcher_cleanup(mpirun, clean_env):
    """Without -disable-auto-cleanup the launcher ends the job; nothing may be left over."""
    job = run_job(mpirun, clean_env, 2, "kill-sigkill", 1, "shm", DEATH_TIMEOUT,
                  auto_cleanup=True)
    assert 1 in job.faults, job.log()
    # Rank 0 ended with its own error (a non-zero exit it reported) or was ended by the
    # launcher (its wrapper then reports nothing): either way its process is gone and it
    # never completed its training loop.
    assert 0 in job.ready, job.log()
    assert job.exits.get(0) != 0, job.log()
    assert not _running(job.ready[0]), job.log()
    loop = job.results.get((0, "loop"))
    assert loop is None or loop.outcome == "error", (loop, job.log())


# --- a rank stalls --------------------------------------------------------------------

STALL_TIMEOUT = 3.0
# After the timeout: scheduling on 2 oversubscribed cores, and TensorFlow's error path. Not a
# speed bound (the TIMING lines show the figures): the error must come after the timeout, not
# before, and long before a hang would show.
STALL_SLACK = 15.0
_WARNING = re.compile(r"keras_ring: WARNING: rank (?P<rank>\d+) has waited (?P<s>\d+) s in "
                      r"(?P<coll>\w+ '[^']*'): ranks not yet heard from: (?P<missing>[\d, ]+)")


STALLS = [(2, "shm"), (2, "tcp"), (4, "shm")]
STALL_IDS = ["np2-shm", "np2-tcp", "np4-shm"]


@pytest.mark.parametrize("np_,transport", STALLS, ids=STALL_IDS)
def test_stalled_rank_warns_then_every_rank_fails(mpirun, clean_env, np_, transport):
    stalled = 1
    job = run_job(mpirun, clean_env, np_, "stall", stalled, transport, STALL_TIMEOUT)
    fault = job.faults[stalled]
    warnings = {int(m["rank"]): m for m in _WARNING.finditer(job.stderr)}
    times = {}
    for r in range(np_):
        if r == stalled:
            continue
        assert r in warnings, f"rank {r} printed no stall warning\n{job.stderr[-3000:]}"
        w = warnings[r]
        assert w["coll"] == "allreduce 'grad'" and int(w["s"]) >= 1, w.group(0)
        assert str(stalled) in [m.strip() for m in w["missing"].split(",")], w.group(0)
        assert _left_with(job, r, 3), job.log()
        res = job.result(r, "loop")
        assert res.error in ("CollectiveTimeoutError", "PeerFailureError"), res
        times[r] = res.t - fault
    # The stalled rank wakes after the others gave up; its next collective fails at once.
    woke = job.result(stalled, "loop")
    assert woke.outcome == "error" and woke.error in ("PeerFailureError", "CollectiveAbortedError",
                                                      "CollectiveTimeoutError"), woke
    assert woke.t - fault < STALL_TIMEOUT + 1 + STALL_SLACK, woke
    assert _left_with(job, stalled, 3), job.log()
    _timing(f"stalled rank np={np_} {transport}", STALL_TIMEOUT + STALL_SLACK, times)
    for r, t in times.items():
        assert STALL_TIMEOUT - 0.5 <= t <= STALL_TIMEOUT + STALL_SLACK, (r, t, job.log())


@pytest.mark.parametrize("np_,transport", STALLS, ids=STALL_IDS)
def test_every_waiting_rank_times_out_naming_the_stalled_rank(mpirun, clean_env, np_, transport):
    """A timeout error that names the stalled rank on every rank, not a neighbour's abort."""
    stalled = 1
    job = run_job(mpirun, clean_env, np_, "stall", stalled, transport, STALL_TIMEOUT)
    problems = []
    for r in range(np_):
        if r == stalled:
            continue
        res = job.result(r, "loop")
        try:
            assert res.error == "CollectiveTimeoutError", f"rank {r}: {res.error}: {res.msg}"
            _assert_names(res, stalled, ["allreduce 'grad'"], job)
        except AssertionError as e:
            problems.append(str(e).split("\n")[0])
    assert not problems, "\n".join(problems)


# --- divergent programs -----------------------------------------------------------------

MISMATCH_TIMEOUT = 5.0
# case -> (error class, fragments every rank's message must contain)
MISMATCHES = {
    "shape": ("CollectiveMismatchError", ["allreduce 'shape_case' shape mismatch", "[1000]", "[1001]"]),
    "shape_big": ("CollectiveMismatchError", ["allreduce 'shape_big_case' shape mismatch", "[262145]"]),
    "dtype": ("CollectiveMismatchError", ["allreduce 'd' dtype mismatch", "float32", "float64"]),
    "op": ("CollectiveMismatchError", ["allreduce 'op_case' reduce op mismatch", "Sum", "Max"]),
    "root": ("CollectiveMismatchError", ["broadcast 'root_case' root rank mismatch", "root 0"]),
    "root_range": ("CollectiveArgumentError", ["broadcast 'w'", "out of range"]),
    "name": ("CollectiveMismatchError", ["name mismatch", "'the_name'", "'other_name'"]),
    "kind": ("CollectiveMismatchError", ["operation mismatch", "allreduce", "allgather 'k'"]),
    "gather_rows": ("CollectiveMismatchError", ["allgather 'rows' shape mismatch", "[4]", "[5]"]),
    "grouped": ("CollectiveMismatchError", ["grouped_allreduce 'g' dtype/shape mismatch: tensor 0 has"]),
    "only_some": ("CollectiveMismatchError", ["name mismatch", "'next'", "'only_some'"]),
    # Inside tf.function the graph runtime raises it; it is keras_ring's class there too.
    "function": ("CollectiveMismatchError", ["allreduce 'fn' shape mismatch", "[5]", "[6]"]),
}
_SIDES = re.compile(r"rank 0 has (?P<a>.*?), rank (?P<r>\d+) has (?P<b>.*?)(?: \(ranks differing|;|$)")


MISMATCH_JOBS = [(2, "shm", 1), (2, "tcp", 0), (4, "tcp", 3)]
MISMATCH_IDS = ["np2-shm", "np2-tcp-rank0", "np4-tcp"]


@pytest.mark.parametrize("np_,transport,odd", MISMATCH_JOBS, ids=MISMATCH_IDS)
def test_mismatches_fail_every_rank_and_runtime_keeps_working(mpirun, clean_env, np_,
                                                              transport, odd):
    job = run_job(mpirun, clean_env, np_, "mismatch", odd, transport, MISMATCH_TIMEOUT)
    for case, (error, fragments) in MISMATCHES.items():
        for r in range(np_):
            res = job.result(r, case)
            assert res.outcome == "error" and res.error == error, (case, res)
            for fragment in fragments:
                assert fragment in res.msg, (case, fragment, res.msg)
            # Detected, not timed out: the error class says so (a timeout is a
            # CollectiveTimeoutError). No wall-clock bound: each wait has its own deadline, so
            # on loaded cores a detected mismatch may still take longer than one timeout.
            if case != "root_range":  # .rank: the diverging rank
                assert res.peer == (odd if odd != 0 else 1), (case, res)
            after = job.result(r, case + "/after")
            assert after.outcome == "ok", (case, after)  # the runtime keeps working
    assert all(job.exits.get(r) == 3 for r in range(np_)), job.log()


@pytest.mark.parametrize("np_,transport,odd", MISMATCH_JOBS, ids=MISMATCH_IDS)
def test_mismatch_messages_say_what_differs(mpirun, clean_env, np_, transport, odd):
    """'rank 0 has A, rank N has B' with A == B does not tell the user what diverged."""
    job = run_job(mpirun, clean_env, np_, "mismatch", odd, transport, MISMATCH_TIMEOUT)
    problems = set()
    for case in MISMATCHES:
        for r in range(np_):
            sides = _SIDES.search(job.result(r, case).msg)
            if sides and sides["a"] == sides["b"]:
                problems.add(f"{case}: {job.result(r, case).msg}")
    assert not problems, "\n".join(sorted(problems))


# --- uneven step counts -----------------------------------------------------------------

@pytest.mark.parametrize("np_,transport", [(2, "shm"), (4, "tcp")], ids=["np2-shm", "np4-tcp"])
def test_uneven_steps_fail_at_the_epoch_end(mpirun, clean_env, np_, transport):
    """One rank has one more batch; the epoch-end metric average meets its extra step."""
    extra = np_ - 1
    job = run_job(mpirun, clean_env, np_, "uneven", extra, transport, MISMATCH_TIMEOUT)
    fault = job.faults[extra]
    times = {}
    for r in range(np_):
        res = job.result(r, "epoch")
        assert res.error == "CollectiveMismatchError", res
        assert "'epoch_end.metrics'" in res.msg and "'grad'" in res.msg, res.msg
        assert res.peer == extra, res
        times[r] = res.t - fault
        assert job.exits.get(r) == 3, job.log()
    _timing(f"uneven steps np={np_} {transport}", MISMATCH_TIMEOUT / 2, times)
    assert all(t <= MISMATCH_TIMEOUT / 2 for t in times.values()), times


def test_uneven_steps_when_the_others_finish(mpirun, clean_env):
    """The others end cleanly; the rank with the extra step must fail, not wait forever."""
    job = run_job(mpirun, clean_env, 2, "uneven-exit", 1, "shm", MISMATCH_TIMEOUT)
    assert job.exits.get(0) == 0, job.log()
    assert job.result(0, "epoch").outcome == "ok"
    res = job.result(1, "epoch")
    assert res.error == "PeerFailureError" and res.peer == 0, res
    assert "allreduce 'grad'" in res.msg, res.msg
    assert job.exits.get(1) == 3, job.log()
    _timing("uneven steps, others exit, shm", MISMATCH_TIMEOUT, {1: res.t - job.faults[1]})
    assert res.t - job.faults[1] <= MISMATCH_TIMEOUT


def test_a_clean_shutdown_is_not_reported_as_a_failure(mpirun, clean_env):
    """Rank 0 shut down normally: saying it had an error sends the user hunting for one."""
    job = run_job(mpirun, clean_env, 2, "uneven-exit", 1, "shm", MISMATCH_TIMEOUT)
    msg = job.result(1, "epoch").msg
    assert "error of its own" not in msg, msg


# --- signals to mpirun --------------------------------------------------------------------

# From the signal to each rank's error, and to every rank process having exited (Python and
# TensorFlow teardown included): margins a loaded machine passes; typical figures are well
# under a second (TIMING lines with -s). What they catch is a rank that never ends.
SIGNAL_BOUND = 20.0
GONE_BOUND = 30.0


@pytest.mark.parametrize("np_,transport,signame,auto_cleanup", [
    (2, "shm", "SIGINT", True), (2, "tcp", "SIGTERM", False), (4, "shm", "SIGINT", False)],
    ids=["np2-shm-SIGINT", "np2-tcp-SIGTERM-nocleanup", "np4-shm-SIGINT-nocleanup"])
def test_signal_to_mpirun_ends_every_rank(mpirun, clean_env, np_, transport, signame,
                                          auto_cleanup):
    sig = getattr(signal, signame)
    before = _shm_names()
    cmd = [*private_shm.COMMAND, mpirun, *([] if auto_cleanup else ["-disable-auto-cleanup"]),
           "-np", str(np_), sys.executable, str(CHILD), "signal", "0"]
    proc = subprocess.Popen(cmd, env=_env(clean_env, transport, 30), cwd=CHILD.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    out_lines, err_lines, arrived = [], [], queue.Queue()

    def pump(stream, sink, notify):
        for line in stream:
            sink.append(line)
            if notify:
                arrived.put(line)

    readers = [threading.Thread(target=pump, args=(proc.stdout, out_lines, True), daemon=True),
               threading.Thread(target=pump, args=(proc.stderr, err_lines, False), daemon=True)]
    for t in readers:
        t.start()
    pids = {}
    try:
        looping, deadline = 0, time.monotonic() + GUARD
        while looping < np_:
            line = arrived.get(timeout=max(0.0, deadline - time.monotonic()))
            looping += line.startswith("LOOPING")
        pids = parse(Job(0, "".join(out_lines), "")).ready
        time.sleep(0.3)  # every rank is inside its loop of collectives now
        sent = time.monotonic()
        proc.send_signal(sig)
        alive = _wait_gone(pids.values(), GONE_BOUND)
        gone_after = time.monotonic() - sent
        proc.wait(timeout=GUARD)
        for t in readers:
            t.join(timeout=GUARD)
    except BaseException:
        _kill_everything(proc, pids.values())
        raise
    job = parse(Job(proc.returncode, "".join(out_lines), "".join(err_lines)))
    assert not alive, f"ranks {alive} still running {GONE_BOUND} s after {signame}\n{job.log()}"
    assert proc.returncode != 0, job.log()
    times = {r: res.t - sent for (r, case), res in job.results.items() if case == "loop"}
    if sig == signal.SIGINT:
        # Python's Ctrl-C semantics: KeyboardInterrupt (or the collective's abort error).
        for r in range(np_):
            res = job.result(r, "loop")
            assert res.error in ("KeyboardInterrupt", "CollectiveAbortedError"), res
    _timing(f"{signame} to mpirun np={np_} {transport} (all ranks gone after "
            f"{gone_after:.2f} s)", SIGNAL_BOUND, times)
    assert all(0 <= t <= SIGNAL_BOUND for t in times.values()), times
    _check_clean(before, job)
