"""``keras-ring-run``: start a keras_ring job through mpirun, with rank-prefixed output.

```
keras-ring-run -np 4 python train.py --epochs 10
keras-ring-run -np 4 -H host1:2,host2:2 python train.py
keras-ring-run -np 2 --mpirun /opt/mpich/bin/mpirun python train.py
```

It finds ``mpirun`` (the one next to this Python, i.e. the ``mpich`` wheel's, else the one on
``PATH``, or ``--mpirun``), runs every rank under a small wrapper that prefixes each line
the rank prints with ``[rank] `` and reports how the rank ended, stops every rank as soon as
one fails and exits with that first failing rank's exit code, and on Ctrl-C stops every rank
and exits with 130. Its stdin goes to rank 0 (the others read none); when the reader of its
output goes away (``| head``) it ends the job and exits with 141. Plain
``mpirun -np 4 python train.py`` keeps working without it.

This module imports nothing but the standard library: the per-rank wrapper runs it as a
script (``python -I launcher.py``), which must start fast and must not load TensorFlow.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

WRAPPER_FLAG = "--keras-ring-rank-wrapper"
_TOKEN_ENV = "KERAS_RING_RUN_TOKEN"
# Each rank's wrapper sends its output to the launcher in frames, so the launcher knows
# whose bytes it holds even in partial lines: b"\x1eKR <token> <rank> <sink> <n>\n" and n
# bytes (sink 1 or 2: stdout or stderr), or b"\x1eKR <token> <rank> exit <code>\n".
_FRAME = b"\x1eKR "
_FRAME_PAYLOAD = 3072  # header + payload stay below PIPE_BUF: one atomic write per frame
# A partial line (a progress bar's state after "\r") is forwarded once the stream has been
# quiet this long, so pieces written together still travel together, and at the latest this
# long after it began, so a line that grows without pause still shows.
_QUIET_SECONDS = 0.05
_PARTIAL_MAX_SECONDS = 1.0
# The exit status of a program that wrote to a pipe whose reader had gone (128 + SIGPIPE),
# as a shell reports it.
_BROKEN_PIPE_EXIT = 141
_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "KERAS_RING_RANK", "SLURM_PROCID")
_FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
# How long mpirun may take to wind the ranks down after a stop request before it is killed.
_STOP_GRACE_SECONDS = 15.0


class LaunchError(Exception):
    """The job could not be started: no mpirun, or invalid arguments."""


# --- the launcher ---------------------------------------------------------------------------

def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="keras-ring-run",
        description="Run a command as a keras_ring job of N ranks through mpirun.",
        epilog="Example: keras-ring-run -np 4 python train.py",
    )
    parser.add_argument("-np", "-n", dest="np", type=int, default=None, metavar="N",
                        help="number of ranks (may exceed the number of cores); in an "
                        "elastic job, the initial number of workers (default --min-np)")
    parser.add_argument("-H", "--hosts", default=None, metavar="HOST:SLOTS,...",
                        help="hosts and their slots, e.g. host1:2,host2:2 (default: this host)")
    parser.add_argument("--mpirun", default=None, metavar="PATH",
                        help="the mpirun to use (default: next to this Python, else on PATH)")
    elastic = parser.add_argument_group(
        "elastic jobs", "workers may leave and join; see keras_ring.elastic (no MPI)")
    elastic.add_argument("--min-np", type=int, default=None, metavar="N",
                         help="the fewest workers the job trains with")
    elastic.add_argument("--max-np", type=int, default=None, metavar="M",
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
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the program each rank runs, e.g. python train.py")
    args = parser.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        parser.error("no command given: e.g. keras-ring-run -np 2 python train.py")
    args.elastic = any(v is not None for v in (args.min_np, args.max_np,
                                                 args.host_discovery_script))
    if args.elastic:
        _check_elastic(parser, args)
    elif args.np is None:
        parser.error("-np is required: e.g. keras-ring-run -np 2 python train.py")
    if args.np < 1:
        parser.error(f"-np must be at least 1, got {args.np}")
    return args


def _check_elastic(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    missing = [flag for flag, value in (("--min-np", args.min_np), ("--max-np", args.max_np),
                                        ("--host-discovery-script", args.host_discovery_script))
               if value is None]
    if missing:
        parser.error(f"an elastic job needs {', '.join(missing)} too (with --min-np, "
                     "--max-np and --host-discovery-script)")
    if args.hosts:
        parser.error("-H and --host-discovery-script exclude each other: the script names "
                     "the hosts of an elastic job")
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
                   command: list[str]) -> list[str]:
    """The full mpirun command line: every rank runs ``command`` under the wrapper."""
    wrapper = [sys.executable, "-I", str(Path(__file__).resolve()), WRAPPER_FLAG, "--", *command]
    if flavour == "openmpi":
        # Open MPI refuses more ranks than cores unless told; Hydra never refuses.
        cmd = [mpirun, "-np", str(np), "--oversubscribe", "--bind-to", "none", "-x", _TOKEN_ENV]
        if hosts:
            cmd += ["-H", hosts]
    else:
        cmd = [mpirun, "-np", str(np)]
        if hosts:
            cmd += ["-hosts", hosts]
    return cmd + wrapper


class _Job:
    """mpirun running the ranks; pumps their output and stops them when asked."""

    def __init__(self, cmd: list[str], env: dict[str, str], token: bytes, ranks: int) -> None:
        self.token = token
        self.ranks = ranks
        self.reported = 0  # ranks whose wrapper told how they ended
        self.first_failure: tuple[int, int] | None = None  # (rank, exit code)
        self.interrupted = False
        self.reader_gone = False  # a broken pipe: whoever read our output stopped reading
        self._stopping = threading.Lock()
        self._stop_requested = False
        # stdin is inherited: mpirun forwards it to rank 0, as it does without the launcher.
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True)
        # One screen where stdout and stderr are one file (a terminal, 2>&1): a rank's
        # partial line on one is ended before a line on the other.
        screen = _Screen() if _same_file(sys.stdout, sys.stderr) else None
        self._pumps = [
            threading.Thread(target=self._pump, args=(source, sink, screen), daemon=True)
            for source, sink in ((self.proc.stdout, sys.stdout), (self.proc.stderr, sys.stderr))
        ]
        for t in self._pumps:
            t.start()

    def _pump(self, source, sink, screen: _Screen | None) -> None:
        out = _Sink(sink, self._on_reader_gone)
        reader = _FrameReader(self.token, Renderer(out, screen), self._on_exit)
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

    def _on_exit(self, rank: int, code: int) -> None:
        self.reported += 1
        if code != 0 and self.first_failure is None:
            self.first_failure = (rank, code)
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

    def wait(self) -> int:
        code = self.proc.wait()
        for t in self._pumps:
            t.join()
        if self.interrupted:
            return 130
        if self.reader_gone:
            return _BROKEN_PIPE_EXIT
        if self.first_failure is not None:
            return self.first_failure[1]
        code = code if code >= 0 else 128 - code
        if self.reported < self.ranks:
            # Killed before its wrapper could tell: MPICH's mpirun kills every rank when one
            # that started MPI leaves without finalizing it (os._exit), and may exit 0.
            print(f"keras-ring-run: {self.ranks - self.reported} of {self.ranks} ranks ended "
                  "without an exit status (killed by mpirun, e.g. after another rank left "
                  "with os._exit); the job failed", file=sys.stderr)
            return code or 1
        return code


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``keras-ring-run``; returns the job's exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [WRAPPER_FLAG]:
        return _wrapper_main(argv[1:])
    args = parse_args(argv)
    try:
        mpirun = find_mpirun(args.mpirun)
        cmd = mpirun_command(mpirun, mpi_flavour(mpirun), args.np, args.hosts, args.command)
    except LaunchError as e:
        print(f"keras-ring-run: {e}", file=sys.stderr)
        return 2
    token = secrets.token_hex(8)
    env = dict(os.environ, **{_TOKEN_ENV: token})
    job = _Job(cmd, env, token.encode(), args.np)

    def on_signal(signum, frame):
        job.interrupted = job.interrupted or signum == signal.SIGINT
        if job._stop_requested:  # a second Ctrl-C: no more patience
            try:
                os.killpg(job.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        job.stop(signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    return job.wait()


# --- the per-rank wrapper -------------------------------------------------------------------

def _rank() -> str:
    for name in _RANK_VARIABLES:
        if os.environ.get(name, "").isdigit():
            return os.environ[name]
    return "?"


def _die_with_parent(sig: int) -> None:
    """Linux: deliver ``sig`` to this process when its parent exits (no-op elsewhere)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, sig, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _forward_output(child: subprocess.Popen, rank: str, token: bytes) -> None:
    """Sends the child's stdout and stderr to ours in frames, live: whole lines and
    carriage-return updates at once, the partial line after them once its stream has been
    quiet for a moment (or has grown for a second)."""
    selector = selectors.DefaultSelector()
    pending: dict[int, bytes] = {}
    began: dict[int, float] = {}  # when each pending partial line began to arrive
    last: dict[int, float] = {}  # when its latest piece arrived
    for source, sink in ((child.stdout, 1), (child.stderr, 2)):
        selector.register(source, selectors.EVENT_READ, sink)
        pending[sink] = b""

    def due(sink: int) -> float:
        return min(last[sink] + _QUIET_SECONDS, began[sink] + _PARTIAL_MAX_SECONDS)

    while selector.get_map():
        timeout = min(map(due, last), default=None)
        events = selector.select(None if timeout is None else max(0.0, timeout - time.monotonic()))
        now = time.monotonic()
        for key, _ in events:
            chunk = os.read(key.fd, 65536)
            sink = key.data
            if not chunk:
                selector.unregister(key.fileobj)
                _send_frames(sink, rank, token, pending.pop(sink))
                began.pop(sink, None)
                last.pop(sink, None)
                continue
            data = pending[sink] + chunk
            cut = _whole_part(data)
            if cut:
                _send_frames(sink, rank, token, data[:cut])
                began.pop(sink, None)  # what is left is a new partial line
            pending[sink] = data[cut:]
            if pending[sink]:
                began.setdefault(sink, now)
                last[sink] = now
            else:
                began.pop(sink, None)
                last.pop(sink, None)
        for sink in [s for s in last if due(s) <= now]:
            _send_frames(sink, rank, token, pending[sink])
            pending[sink] = b""
            del began[sink], last[sink]


def _whole_part(data: bytes) -> int:
    """How much of ``data`` is whole: up to its last newline, or up to its last carriage
    return that something follows (the progress bar's state before the latest one)."""
    return max(data.rfind(b"\n"), data.rfind(b"\r", 0, len(data) - 1)) + 1


def _send_frames(sink: int, rank: str, token: bytes, data: bytes) -> None:
    """Frames end at a line's end where one fits, so frames of other ranks that arrive in
    between fall between whole lines (only a line longer than a frame is ever cut)."""
    start = 0
    while start < len(data):
        end = min(start + _FRAME_PAYLOAD, len(data))
        if end < len(data):
            end = data.rfind(b"\n", start, end) + 1 or end
        payload = data[start:end]
        _write_all(sink, b"%s%s %s %d %d\n%s" % (_FRAME, token, rank.encode(), sink,
                                                len(payload), payload))
        start = end


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def _wrapper_main(argv: list[str]) -> int:
    command = argv[1:] if argv[:1] == ["--"] else argv
    rank = _rank()
    _die_with_parent(signal.SIGTERM)  # if mpirun's proxy dies, take the rank down too
    # close_fds=False: the rank must inherit the launcher's descriptors (e.g. Hydra's PMI_FD).
    try:
        # mpirun forwards the launcher's stdin to rank 0; the other ranks read nothing (under
        # plain mpirun, a read there waits forever).
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 stdin=None if rank == "0" else subprocess.DEVNULL,
                                 close_fds=False,
                                 preexec_fn=lambda: _die_with_parent(signal.SIGKILL))
    except OSError as e:
        _write_all(2, f"[{rank}] keras-ring-run: cannot run {command[0]!r}: {e}\n".encode())
        return _report(rank, 127)
    for sig in _FORWARDED_SIGNALS:
        signal.signal(sig, lambda signum, frame: child.send_signal(signum))
    _forward_output(child, rank, os.environ.get(_TOKEN_ENV, "").encode())
    code = child.wait()
    return _report(rank, code if code >= 0 else 128 - code)


def _report(rank: str, code: int) -> int:
    """Tells the launcher how this rank ended (a frame it consumes), returns ``code``."""
    token = os.environ.get(_TOKEN_ENV)
    if token:
        _write_all(2, b"%s%s %s exit %d\n" % (_FRAME, token.encode(), rank.encode(), code))
    return code


# --- the launcher's side of the frames ----------------------------------------------------------

class _Screen:
    """Where rendered lines meet: the partial line now open on it, and whose it is. Two
    renderers share one where stdout and stderr are the same file (a terminal)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # one pump thread per stream writes to it
        self.open: tuple[Renderer, str] | None = None  # (stream's renderer, rank)

    def end_line(self) -> None:
        if self.open is not None:
            renderer, _ = self.open
            self.open = None
            renderer._write(b"\n")


class Renderer:
    """Writes the ranks' output to one stream with ``[rank] `` at the start of every line and
    after every carriage return, so a rank's progress bar updates in place; a rank's partial
    line is ended before another rank's output (or its own on the other stream, where both
    streams share ``screen``), so two ranks never share a line."""

    def __init__(self, out, screen: _Screen | None = None) -> None:
        self.out = out
        self.screen = screen or _Screen()
        self.after_return = False  # the open line was last taken back to its start by "\r"

    def rank_output(self, rank: str, data: bytes) -> None:
        if not data:
            return
        prefix = b"[%s] " % rank.encode()
        with self.screen.lock:
            at_start = self.screen.open != (self, rank)
            if at_start:
                self.screen.end_line()
            at_start = at_start or self.after_return
            parts = []
            for piece in re.split(rb"(?<=[\r\n])", data):
                if piece:
                    parts.append(prefix + piece if at_start else piece)
                    at_start = piece.endswith((b"\n", b"\r"))
            self.screen.open = None if data.endswith(b"\n") else (self, rank)
            self.after_return = data.endswith(b"\r")
            self._write(b"".join(parts))

    def raw(self, data: bytes) -> None:
        """Bytes that are nobody's frames (mpirun's own messages), passed through."""
        if data:
            with self.screen.lock:
                self.screen.end_line()
                self._write(data)

    def close(self) -> None:
        with self.screen.lock:
            if self.screen.open is not None and self.screen.open[0] is self:
                self.screen.end_line()

    def _write(self, data: bytes) -> None:
        self.out.write(data)
        self.out.flush()


class _Sink:
    """The launcher's stdout or stderr as bytes. When its reader has gone (a broken pipe),
    it says so once and then drops what it is given."""

    def __init__(self, stream, on_reader_gone) -> None:
        self.out = getattr(stream, "buffer", stream)
        self.on_reader_gone = on_reader_gone
        self.gone = False

    def write(self, data: bytes) -> None:
        if self.gone:
            return
        try:
            self.out.write(data)
            self.out.flush()
        except BrokenPipeError:
            self.gone = True
            # Python would try the unwritten bytes again at exit and complain.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.out.fileno())
            os.close(devnull)
            self.on_reader_gone()

    def flush(self) -> None:
        pass  # write() flushed


def _same_file(a, b) -> bool:
    try:
        sa, sb = os.fstat(a.fileno()), os.fstat(b.fileno())
    except (OSError, ValueError, AttributeError):  # closed, or not a real file
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


class _FrameReader:
    """Splits the merged output of mpirun into the ranks' frames (see ``_FRAME``)."""

    def __init__(self, token: bytes, renderer: Renderer, on_exit) -> None:
        self.token, self.renderer, self.on_exit = token, renderer, on_exit
        self.buffer = b""

    def feed(self, chunk: bytes) -> None:
        self.buffer += chunk
        while self.buffer:
            start = self.buffer.find(_FRAME)
            if start != 0:
                # Pass through what precedes a frame; keep a tail that may begin one.
                keep = start if start > 0 else self._possible_frame_start()
                self.renderer.raw(self.buffer[:keep])
                self.buffer = self.buffer[keep:]
                if start < 0:
                    return
            end = self.buffer.find(b"\n")
            if end < 0:
                return  # the header is still arriving
            fields = self.buffer[len(_FRAME):end].split()
            if len(fields) == 4 and fields[0] == self.token and fields[2] == b"exit":
                self.buffer = self.buffer[end + 1:]
                self.on_exit(int(fields[1]) if fields[1].isdigit() else -1, int(fields[3]))
                continue
            if len(fields) != 4 or fields[0] != self.token or not fields[3].isdigit():
                self.renderer.raw(self.buffer[:end + 1])  # not ours after all
                self.buffer = self.buffer[end + 1:]
                continue
            size = int(fields[3])
            if len(self.buffer) < end + 1 + size:
                return  # the payload is still arriving
            self.renderer.rank_output(fields[1].decode(), self.buffer[end + 1:end + 1 + size])
            self.buffer = self.buffer[end + 1 + size:]

    def _possible_frame_start(self) -> int:
        """Where a frame marker may begin at the end of the buffer (else its length)."""
        for k in range(min(len(_FRAME) - 1, len(self.buffer)), 0, -1):
            if _FRAME.startswith(self.buffer[-k:]):
                return len(self.buffer) - k
        return len(self.buffer)

    def close(self) -> None:
        self.renderer.raw(self.buffer)
        self.buffer = b""
        self.renderer.close()


if __name__ == "__main__":
    sys.exit(main())
