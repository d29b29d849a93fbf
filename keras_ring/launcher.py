"""``keras-ring-run``: start a keras_ring job through mpirun, with rank-prefixed output.

```
keras-ring-run -np 4 python train.py --epochs 10
keras-ring-run -np 4 -H host1:2,host2:2 python train.py
keras-ring-run -np 4 --hostfile hosts python train.py   # lines of "host1 slots=2"
keras-ring-run -np 2 --mpirun /opt/mpich/bin/mpirun python train.py
```

It finds ``mpirun`` (the one next to this Python, i.e. the ``mpich`` wheel's, else the one on
``PATH``, or ``--mpirun``), runs every rank under a small wrapper that prefixes each line
the rank prints with ``[rank] `` and reports how the rank ended, stops every rank as soon as
one fails and exits with that rank's exit code (a rank whose failure another's caused waits
a moment for that one's; a rank that caught a peer's timeout and ended normally stops the
job too, with exit code 1), names the ranks still running long after one ended normally,
and on Ctrl-C stops every rank and exits with 130 (on SIGTERM, 143). Its stdin goes to rank 0
(the others read none); when the reader of its output goes away (``| head``) it ends the job
and exits with 141; where its output cannot be written (a full disk) it ends the job and
exits with 74. Under ``nohup`` a hangup leaves the job running. After the job, it removes the MPICH shared memory its stopped ranks left
(``_mpich_shm``). Plain ``mpirun -np 4 python train.py`` keeps working without it.

The wrapper is ``_rank_wrapper``; the launcher's side of its frames is ``_launch_output``.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from keras_ring import _horovodrun_flags, _mpich_shm, _rank_wrapper
from keras_ring._launch_output import FrameReader, Renderer, Screen, Sink, same_file

_WRAPPER = str(Path(_rank_wrapper.__file__).resolve())
# The exit status of a program that wrote to a pipe whose reader had gone (128 + SIGPIPE),
# as a shell reports it.
_BROKEN_PIPE_EXIT = 141
# Where the job's output cannot be written (sysexits' EX_IOERR).
_OUTPUT_ERROR_EXIT = 74
# How long mpirun may take to wind the ranks down after a stop request before it is killed.
_STOP_GRACE_SECONDS = 15.0
# How often the main thread wakes while it waits for mpirun, to run Python's signal handlers.
_AWAKE_SECONDS = 0.2
# How long a rank's failure that another rank's caused waits for that rank to report its own.
_CAUSE_WAIT_SECONDS = 10.0
_PR_SET_PDEATHSIG = 1  # prctl option, <linux/prctl.h>
# A rank's stall warning comes after this long in one collective; the launcher says as long
# after a rank ended normally that others still run, and again at twice the wait each time.
_STALL_WARNING_VARIABLE = "KERAS_RING_STALL_WARNING_SECONDS"
_DEFAULT_STALL_WARNING_SECONDS = 60.0


class LaunchError(Exception):
    """The job could not be started: no mpirun, or invalid arguments."""


# --- the launcher ---------------------------------------------------------------------------

def _version() -> str:
    try:
        return importlib.metadata.version("keras-ring")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout never installed
        return "not installed"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="keras-ring-run",
        description="Run a command as a keras_ring job of N ranks through mpirun.",
        epilog="Example: keras-ring-run -np 4 python train.py",
    )
    parser.add_argument("-v", "--version", action="version",
                        version=f"keras-ring-run (keras_ring {_version()})")
    parser.add_argument("-np", "-n", "--num-proc", dest="np", type=int, default=None, metavar="N",
                        help="number of ranks (may exceed the number of cores); in an "
                        "elastic job, the initial number of workers (default --min-np)")
    parser.add_argument("-H", "--hosts", default=None, metavar="HOST:SLOTS,...",
                        help="hosts and their slots, e.g. host1:2,host2:2 (default: this host)")
    # Both spellings are horovodrun's; without "-hostfile" argparse reads it as "-h ostfile".
    parser.add_argument("-hostfile", "--hostfile", default=None, metavar="FILE",
                        help="hosts and their slots, one 'hostname slots=N' line each "
                        "(horovodrun's format; instead of -H)")
    parser.add_argument("--mpirun", default=None, metavar="PATH",
                        help="the mpirun to use (default: next to this Python, else on PATH)")
    elastic = parser.add_argument_group(
        "elastic jobs", "workers may leave and join; see keras_ring.elastic (no MPI)")
    # --min-num-proc/--max-num-proc: horovodrun's long spellings.
    elastic.add_argument("--min-np", "--min-num-proc", type=int, default=None, metavar="N",
                         help="the fewest workers the job trains with")
    elastic.add_argument("--max-np", "--max-num-proc", type=int, default=None, metavar="M",
                         help="the most workers the job trains with")
    elastic.add_argument("--host-discovery-script", default=None, metavar="SCRIPT",
                         help="prints the available hosts, one 'host:slots' line each")
    elastic.add_argument("--discovery-interval", type=float, default=1.0, metavar="SECONDS",
                         help="how often the script runs (default 1)")
    elastic.add_argument("--blacklist-after", type=int, default=2, metavar="K",
                         help="a host whose workers failed K times gets no more (default 2)")
    elastic.add_argument("--remote-shell", default="ssh -o BatchMode=yes", metavar="CMD",
                         help="starts a worker on another host: CMD HOST 'command line'")
    elastic.add_argument("--rendezvous-address", default=None, metavar="ADDRESS",
                         help="where workers reach this launcher (default: its first "
                         "non-loopback address, loopback when every host is this one)")
    _horovodrun_flags.add_to(parser)
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the program each rank runs, e.g. python train.py")
    args = parser.parse_args(argv)
    args.horovodrun = _horovodrun_flags.settings(parser, args)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        parser.error("no command given: e.g. keras-ring-run -np 2 python train.py")
    args.elastic = any(v is not None for v in (args.min_np, args.max_np,
                                                 args.host_discovery_script))
    if args.elastic:
        _check_elastic(parser, args)
        if args.horovodrun.mpi_args:
            parser.error("--mpi-args: an elastic job starts its workers without mpirun")
    elif args.np is None:
        parser.error("-np is required: e.g. keras-ring-run -np 2 python train.py")
    if args.np < 1:
        parser.error(f"-np must be at least 1, got {args.np}")
    if not args.elastic:
        _check_hosts(parser, args)
    return args


def _check_hosts(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reads ``--hostfile`` into ``args.hosts``; refuses ``-np`` beyond the hosts' slots
    (Hydra would start the extra ranks on the same hosts again)."""
    if args.hostfile is not None:
        if args.hosts:
            parser.error("-H and --hostfile exclude each other: both name the hosts")
        try:
            args.hosts = read_hostfile(args.hostfile)
        except (OSError, ValueError) as e:
            parser.error(str(e))
    if not args.hosts:
        return
    try:
        slots = count_slots(args.hosts)
    except ValueError as e:
        parser.error(str(e))
    if args.np > slots:
        origin = f"--hostfile {args.hostfile}" if args.hostfile else f"-H {args.hosts}"
        parser.error(f"-np {args.np} is more than the {slots} slot(s) of {origin}: give "
                     f"-np {slots} or fewer, or more slots")


def read_hostfile(path: str) -> str:
    """horovodrun's hostfile (``hostname slots=N`` lines; blank lines and ``#`` comments
    skipped) as a ``-H`` value: ``host1:2,host2:2``."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    hosts = []
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        match = re.fullmatch(r"(\S+)\s+slots\s*=\s*(\d+)", text)
        if match is None or int(match[2]) < 1:
            raise ValueError(f"--hostfile {path}, line {number}: expected 'hostname slots=N' "
                             f"(N at least 1), got {line!r}")
        hosts.append(f"{match[1]}:{int(match[2])}")
    if not hosts:
        raise ValueError(f"--hostfile {path} names no host: expected 'hostname slots=N' lines")
    return ",".join(hosts)


def count_slots(hosts: str) -> int:
    """The slots of a ``-H`` value (``host1:2,host2``: a host without a count has one)."""
    total = 0
    for entry in hosts.split(","):
        name, colon, slots = entry.strip().rpartition(":")
        if not colon:
            name, slots = slots, "1"
        if not name or not slots.isdigit() or int(slots) < 1:
            raise ValueError(f"-H {hosts}: expected host:slots entries (slots at least 1) "
                             f"separated by commas, got {entry!r}")
        total += int(slots)
    return total


def _check_elastic(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    missing = [flag for flag, value in (("--min-np", args.min_np), ("--max-np", args.max_np),
                                        ("--host-discovery-script", args.host_discovery_script))
               if value is None]
    if missing:
        parser.error(f"an elastic job needs {', '.join(missing)} too (with --min-np, "
                     "--max-np and --host-discovery-script)")
    if args.hosts or args.hostfile:
        parser.error(f"{'-H' if args.hosts else '--hostfile'} and --host-discovery-script "
                     "exclude each other: the script names the hosts of an elastic job")
    args.np = args.min_np if args.np is None else args.np
    if not 1 <= args.min_np <= args.np <= args.max_np:
        parser.error(f"need 1 <= --min-np <= -np <= --max-np, got --min-np {args.min_np}, "
                     f"-np {args.np}, --max-np {args.max_np}")
    if args.blacklist_after < 1:
        parser.error(f"--blacklist-after must be at least 1, got {args.blacklist_after}")


def find_mpirun(explicit: str | None = None) -> str:
    """The mpirun to use: ``explicit``, else the one next to this Python, else PATH's."""
    if explicit:
        path = shutil.which(explicit)
        if path is None:
            raise LaunchError(f"--mpirun {explicit!r} is not an executable file")
        return path
    beside = Path(sys.executable).parent / "mpirun"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    path = shutil.which("mpirun")
    if path is None:
        raise LaunchError(f"no mpirun next to {sys.executable} nor on PATH: install the "
                          "'mpich' wheel (pip install mpich) or pass --mpirun PATH")
    return path


def mpi_flavour(mpirun: str) -> str:
    """"openmpi" or "hydra" (MPICH, Intel MPI and anything unrecognised)."""
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LaunchError(f"cannot run {mpirun} --version: {e}") from None
    return "openmpi" if b"Open MPI" in out or b"OpenRTE" in out else "hydra"


def mpirun_command(mpirun: str, flavour: str, np: int, hosts: str | None,
                   command: list[str], exported: Iterable[str] = (),
                   mpi_args: Iterable[str] = ()) -> list[str]:
    """The full mpirun command line: every rank runs ``command`` under the wrapper.
    ``exported``: variables set here for the ranks (Hydra passes the whole environment on,
    Open MPI only what ``-x`` names); ``mpi_args``: more of mpirun's own arguments."""
    wrapper = [sys.executable, "-I", _WRAPPER, "--", *command]
    if flavour == "openmpi":
        # Open MPI refuses more ranks than cores unless told; Hydra never refuses.
        cmd = [mpirun, "-np", str(np), "--oversubscribe", "--bind-to", "none"]
        for name in (_rank_wrapper.TOKEN_ENV, *exported):
            cmd += ["-x", name]
        if hosts:
            cmd += ["-H", hosts]
    else:
        cmd = [mpirun, "-np", str(np)]
        if hosts:
            cmd += ["-hosts", hosts]
    return cmd + list(mpi_args) + wrapper


def _say_if_signalled(rank: int, code: int) -> None:
    """Names a rank that a signal killed (SIGKILL: out of memory, say): mpirun's banner names
    only a pid, the rank's wrapper's, and the other ranks are stopped before they can say."""
    try:
        name = signal.Signals(code - 128).name if code > 128 else None
    except ValueError:
        name = None
    if name is not None:
        _say(f"rank {rank} was killed by {name} (exit code {code})")


def _say(text: str) -> None:
    """A line of the launcher's own, on its stderr; where that cannot be written (a full
    disk, closed) on its stdout, else nowhere: the exit code still tells. Never an
    exception, which in an output thread would leave mpirun's output unread."""
    for stream in (sys.stderr, sys.stdout):
        try:
            print(f"keras-ring-run: {text}", file=stream, flush=True)
            return
        except (OSError, ValueError, AttributeError):
            continue


def _end_with(launcher: int) -> None:
    """In mpirun's process before it starts: SIGTERM when the launcher dies. mpirun runs in
    a session of its own (a Ctrl-C reaches the ranks once, through us), so a launcher killed
    by SIGKILL (the OOM killer, ``kill -9``) would otherwise leave the whole job running."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: no such guard
        return
    if os.getppid() != launcher:  # it died before the guard was set
        os.kill(os.getpid(), signal.SIGTERM)


class _Job:
    """mpirun running the ranks; pumps their output and stops them when asked."""

    def __init__(self, cmd: list[str], env: dict[str, str], token: bytes, ranks: int) -> None:
        self.token = token
        self.ranks = ranks
        self.started = 0  # ranks whose wrapper began
        self.ended: set[int] = set()  # ranks whose wrapper told how they ended
        # Ranks still running long after another ended normally: said, so no job waits
        # silently on a rank busy (or stuck) in its own code after its last collective.
        self._linger_seconds = _linger_seconds(env)
        self._linger: threading.Timer | None = None
        self._linger_lock = threading.Lock()
        self._finished = False  # mpirun ended: no more notices
        self._stderr: Renderer | None = None  # the notice ends a rank's open line first
        self.cause: tuple[int, int] | None = None  # (rank, exit code) of the first failure
        # that was not another's consequence, and the first that was
        self.follow_on: tuple[int, int] | None = None
        self._cause_wait: threading.Timer | None = None
        self.gave_up_on_cause = False  # the wait for it ended: later exits echo our stop
        # A rank that ended normally after a peer's timeout, so the job was stopped: later
        # exits echo that stop.
        self.stalled: int | None = None
        self.signalled: int | None = None  # SIGINT or SIGTERM that ended the job
        self.reader_gone = False  # a broken pipe: whoever read our output stopped reading
        self.output_error: str | None = None  # our output could not be written: why
        self._stopping = threading.Lock()
        self._stop_requested = False
        # A second early: file times on tmpfs come from a coarse clock.
        self.began = time.time() - 1.0
        self.segments: set[tuple[str, int]] = set()  # MPICH's, that the ranks held
        # stdin is inherited: mpirun forwards it to rank 0, as it does without the launcher.
        launcher = os.getpid()
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True,
                                     preexec_fn=lambda: _end_with(launcher))
        # One screen where stdout and stderr are one file (a terminal, 2>&1): a rank's
        # partial line on one is ended before a line on the other.
        screen = Screen() if same_file(sys.stdout, sys.stderr) else None
        self._pumps = [
            threading.Thread(target=self._pump, args=(source, sink, screen), daemon=True)
            for source, sink in ((self.proc.stdout, sys.stdout), (self.proc.stderr, sys.stderr))
        ]
        for t in self._pumps:
            t.start()

    def _pump(self, source, sink, screen: Screen | None) -> None:
        out = Sink(sink, self._on_reader_gone,
                   lambda error: self._on_write_error("stdout" if sink is sys.stdout
                                                      else "stderr", error))
        renderer = Renderer(out, screen)
        if sink is sys.stderr:
            self._stderr = renderer
        reader = FrameReader(self.token, renderer, self._on_exit, self._on_start,
                             lambda name, inode: self.segments.add((name, inode)))
        fd = source.fileno()
        # Read to the end even after a broken pipe: mpirun must never block writing to us.
        while chunk := os.read(fd, 65536):
            reader.feed(chunk)
        reader.close()

    def _on_reader_gone(self) -> None:
        """Our stdout or stderr reader stopped reading (``| head``): end the job, as
        SIGPIPE ends a plain mpirun."""
        self.reader_gone = True
        self.stop(signal.SIGTERM)

    def _on_write_error(self, stream: str, error: OSError) -> None:
        """Our stdout or stderr cannot be written (a full disk, a closed descriptor): end the
        job, as a plain mpirun ends it, rather than run on with its output lost."""
        if self.output_error is None:
            self.output_error = f"cannot write the job's output to its {stream}: {error}"
        self.stop(signal.SIGTERM)

    def _on_start(self, rank: int) -> None:
        self.started += 1

    @property
    def first_failure(self) -> tuple[int, int] | None:
        return self.cause or self.follow_on

    def _on_exit(self, rank: int, code: int, follows: bool = False,
                 stalled: bool = False) -> None:
        self.ended.add(rank)
        if code == 0:
            if stalled and self.stalled is None and self.first_failure is None:
                # The program caught a peer's timeout and ended normally; that peer may be
                # unable to run at all (stopped), and would keep the job waiting for ever.
                self.stalled = rank
                self.stop(signal.SIGTERM)
            elif self._linger is None and len(self.ended) < self.ranks:
                self._watch_lingering(rank, time.monotonic(), self._linger_seconds)
            return
        if self.stalled is not None:
            return  # stopped by us: its code echoes the stop
        if not follows:
            if self.cause is None and not self.gave_up_on_cause:
                self.cause = (rank, code)
                _say_if_signalled(rank, code)
                self.stop(signal.SIGTERM)
        elif self.follow_on is None:
            # The rank whose failure this follows is ending too: give it time to report its
            # own exit code (stopping it now would make that 143), but stop a stalled one.
            self.follow_on = (rank, code)
            self._cause_wait = threading.Timer(_CAUSE_WAIT_SECONDS, self._stop_waiting_for_cause)
            self._cause_wait.daemon = True
            self._cause_wait.start()

    def _watch_lingering(self, first: int, since: float, wait: float) -> None:
        with self._linger_lock:
            if self._finished:
                return
            self._linger = threading.Timer(wait, self._say_lingering, (first, since, wait))
            self._linger.daemon = True
            self._linger.start()

    def _say_lingering(self, first: int, since: float, wait: float) -> None:
        """Ranks run on long after rank ``first`` ended normally: says which, and waits."""
        with self._linger_lock:
            running = sorted(set(range(self.ranks)) - self.ended)
            if (self._finished or self._stop_requested or self.first_failure is not None
                    or not running or self._stderr is None):
                return
            names = ", ".join(map(str, running))
            self._stderr.raw(
                f"keras-ring-run: rank {first} ended normally {time.monotonic() - since:.0f} s "
                f"ago; rank{'s' if len(running) > 1 else ''} {names} not yet (a rank's own "
                "code after its last collective: saving, evaluating, or stuck). The job ends "
                "when every rank has; Ctrl-C stops it.\n".encode())
        self._watch_lingering(first, since, 2 * wait)

    def _stop_waiting_for_cause(self) -> None:
        """The follow-on's cause never reported: stop it, and let its 143, our own stop's
        echo, pass for no cause (it would read as a pre-emption to a scheduler)."""
        with self._stopping:
            if self._stop_requested:
                return
            self.gave_up_on_cause = True
        self.stop(signal.SIGTERM)

    def stop(self, sig: int) -> None:
        """Asks mpirun to stop every rank; kills its process group if it lingers."""
        with self._stopping:
            if self._stop_requested:
                return
            self._stop_requested = True
        try:
            self.proc.send_signal(sig)
        except ProcessLookupError:
            return
        threading.Thread(target=self._kill_after_grace, daemon=True).start()

    def _kill_after_grace(self) -> None:
        try:
            self.proc.wait(timeout=_STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def on_signal(self, signum: int) -> None:
        """SIGINT, SIGTERM or SIGHUP (its terminal or ssh session closed) to the launcher:
        stop every rank."""
        # A SIGTERM after a rank failed leaves that rank's exit code; Ctrl-C is always 130.
        if self.signalled != signal.SIGINT and (signum == signal.SIGINT
                                                or self.first_failure is None):
            self.signalled = signum
        # A second Ctrl-C: no more patience. Not a second SIGTERM: one sent to our process
        # group often comes twice (``timeout`` passes its own on), and killed ranks could
        # neither report nor clean up; the grace period bounds the wait.
        if signum == signal.SIGINT and self._stop_requested:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.stop(signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM)

    def wait(self) -> int:
        code = None
        while code is None:
            # In slices: a signal the kernel hands to an output thread only sets Python's
            # flag, and the main thread runs on_signal when it next wakes; in one long wait
            # that was when mpirun ended, and a SIGTERM or Ctrl-C did not stop the job.
            try:
                code = self.proc.wait(timeout=_AWAKE_SECONDS)
            except subprocess.TimeoutExpired:
                pass
        with self._linger_lock:
            self._finished = True
            if self._linger is not None:
                self._linger.cancel()
        for t in self._pumps:
            t.join()
        if self._cause_wait is not None:
            self._cause_wait.cancel()
        try:  # tidying up is no reason to lose the job's exit code
            _mpich_shm.remove_orphans(self.began, self.segments)
        except OSError:
            pass
        return self._exit_code(code if code >= 0 else 128 - code)

    def _exit_code(self, code: int) -> int:
        """The job's exit code, given mpirun's; says why where no rank's code tells."""
        if self.signalled == signal.SIGINT:
            return 130
        if self.reader_gone:
            return _BROKEN_PIPE_EXIT
        if self.output_error is not None:
            _say(f"{self.output_error}; the job was stopped")
            return _OUTPUT_ERROR_EXIT
        if self.signalled is not None:
            # The ranks' own exit codes (143, or none where they were killed) only echo it.
            name = signal.Signals(self.signalled).name
            _say(f"terminated by {name}; the job was stopped")
            return 128 + self.signalled
        if self.gave_up_on_cause and self.cause is None:
            rank, code = self.follow_on
            _say(f"rank {rank} failed because another rank had, and no rank "
                  f"reported a failure of its own within {_CAUSE_WAIT_SECONDS} s; the job "
                  f"was stopped (exit code {code}, rank {rank}'s)")
            return code
        if self.first_failure is not None:
            return self.first_failure[1]
        if self.stalled is not None:
            _say(f"rank {self.stalled} ended normally after a peer did not "
                  "take part in a collective in time (the program caught the "
                  "CollectiveTimeoutError); the job was stopped, and failed")
            return 1
        if self.started < self.ranks:
            _say(f"{self.ranks - self.started} of {self.ranks} ranks never "
                  "started: mpirun could not launch them (its message above says why, e.g. a "
                  "host it cannot reach); the job failed")
            return code or 1
        if len(self.ended) < self.ranks:
            # Killed before its wrapper could tell: MPICH's mpirun kills every rank when one
            # that started MPI leaves without finalizing it (os._exit), and exits 0 or with
            # the signal it killed with (9), which names no rank's failure: 1, as documented.
            _say(f"{self.ranks - len(self.ended)} of {self.ranks} ranks ended "
                  "without an exit status (killed by mpirun, e.g. after another rank left "
                  "with os._exit); the job failed")
            return 1
        return code


def _linger_seconds(env: dict[str, str]) -> float:
    """The ranks' stall-warning time, from the job's environment; its default where the
    value is invalid (the ranks refuse it themselves, saying why)."""
    try:
        value = float(env.get(_STALL_WARNING_VARIABLE) or _DEFAULT_STALL_WARNING_SECONDS)
    except ValueError:
        return _DEFAULT_STALL_WARNING_SECONDS
    return value if 0 < value < float("inf") else _DEFAULT_STALL_WARNING_SECONDS


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``keras-ring-run``; returns the job's exit code."""
    return run(parse_args(sys.argv[1:] if argv is None else argv))


def run(args: argparse.Namespace) -> int:
    """Runs the job ``parse_args`` describes (not elastic); returns its exit code."""
    try:
        mpirun = find_mpirun(args.mpirun)
        cmd = mpirun_command(mpirun, mpi_flavour(mpirun), args.np, args.hosts, args.command,
                             args.horovodrun.env, args.horovodrun.mpi_args)
    except LaunchError as e:
        _say(f"{e}")
        return 2
    token = secrets.token_hex(8)
    env = dict(os.environ, **args.horovodrun.env, **{_rank_wrapper.TOKEN_ENV: token})
    job = _Job(cmd, env, token.encode(), args.np)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        # Under nohup SIGHUP is ignored, and stays so: the job outlives its terminal. (A
        # shell's background job ignores SIGINT too, yet `kill -INT` should still stop it.)
        if sig != signal.SIGHUP or signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, lambda signum, frame: job.on_signal(signum))
    return job.wait()


if __name__ == "__main__":
    sys.exit(main())
