"""The per-rank wrapper of ``keras-ring-run``: runs one rank's program and sends its output
to the launcher in frames, then how it ended.

mpirun starts ``python -I _rank_wrapper.py -- python train.py`` as each rank. It must start
fast and must not load TensorFlow, and ``-I`` leaves its own folder off ``sys.path``: it
imports nothing but the standard library. The launcher's side of the frames is
``keras_ring._launch_output``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import selectors
import signal
import struct
import subprocess
import sys
import tempfile
import time

TOKEN_ENV = "KERAS_RING_RUN_TOKEN"
# Frames, so the launcher knows whose bytes it holds even in partial lines:
# b"\x1eKR <token> <rank> start\n" first (a rank that never sent it was never launched),
# b"\x1eKR <token> <rank> <sink> <n>\n" and n bytes (sink 1 or 2: stdout or stderr),
# b"\x1eKR <token> <rank> shm <name> <inode>\n" once the rank maps MPICH's shared memory
# (_SegmentWatch), and b"\x1eKR <token> <rank> exit <code>[ follows][ stalled]\n" last
# ("follows": the rank failed because another had, see mark_follow_on; "stalled": a peer
# did not take part in time, see mark_stalled_peer).
FRAME = b"\x1eKR "
FRAME_PAYLOAD = 3072  # header + payload stay below PIPE_BUF: one atomic write per frame
# A partial line (a progress bar's state after "\r") is forwarded once the stream has been
# quiet this long, so pieces written together still travel together, and at the latest this
# long after it began, so a line that grows without pause still shows.
_QUIET_SECONDS = 0.05
_PARTIAL_MAX_SECONDS = 1.0
RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "KERAS_RING_RANK",
                  "SLURM_PROCID")
_FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
# "<wrapper pid>:<path>": the file where the rank leaves words on how it ended (_mark).
STATUS_ENV = "KERAS_RING_RUN_STATUS"
MARKS = (b"follows", b"stalled")
SHM_DIRECTORY = "/dev/shm"
SHM_PREFIX = "mpich_shm_"


def mark_follow_on() -> None:
    """Called in the rank (keras_ring's runtime) when the program leaves with an error that
    another rank's failure caused: the launcher then reports that other rank's exit code,
    whichever rank ended first. Nothing outside keras-ring-run, and nothing in a process the
    wrapper did not start itself."""
    _mark(b"follows")


def mark_stalled_peer() -> bool:
    """Called in the rank when it leaves after a peer did not take part in a collective in
    time: that peer may be unable to run at all (stopped), so the launcher stops the job even
    where this rank exits with 0 (the program caught the timeout). Returns whether a wrapper
    will tell keras-ring-run."""
    return _mark(b"stalled")


def _mark(word: bytes) -> bool:
    """Adds ``word`` to the status file the wrapper reads once the rank has ended; returns
    whether it did."""
    wrapper, _, path = os.environ.get(STATUS_ENV, "").partition(":")
    if path and wrapper == str(os.getppid()):
        try:
            # Not O_CREAT: the wrapper made the file; once the wrapper is gone its guard may
            # have removed it, and a rank marking in that moment must not leave a new one.
            fd = os.open(path, os.O_WRONLY | os.O_APPEND)
            try:
                os.write(fd, word + b"\n")
            finally:
                os.close(fd)
            return True
        except OSError:
            pass
    return False


def _marks(path: str) -> tuple[bytes, ...]:
    """The words ``_mark`` left in the status file (which it then removes), known ones only."""
    try:
        with open(path, "rb") as f:
            words = f.read().split()
        os.unlink(path)
    except OSError:
        return ()
    return tuple(m for m in MARKS if m in words)


def _rank() -> str:
    for name in RANK_VARIABLES:
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


class _SegmentWatch:
    """Finds the MPICH shared-memory segment this rank maps, so that the launcher removes
    only its own job's leftovers (``keras_ring._mpich_shm``): a holder of another job's
    segment may be out of sight (a container sharing ``/dev/shm``, with its own PIDs).

    inotify wakes it whenever a process creates or opens an ``mpich_shm_*`` file; the rank's
    descriptor is there from its ``open`` until the mapping replaces it, so one look at both
    finds it. Costs nothing while nobody opens one; does nothing without inotify."""

    _IN_OPEN, _IN_CREATE = 0x20, 0x100
    _EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name

    def __init__(self, pgid: int) -> None:
        self.pgid = pgid
        self.fd = -1
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
            if fd >= 0 and libc.inotify_add_watch(fd, SHM_DIRECTORY.encode(),
                                                  self._IN_OPEN | self._IN_CREATE) < 0:
                os.close(fd)
                fd = -1
            self.fd = fd
        except (OSError, AttributeError):
            pass

    def fileno(self) -> int:
        return self.fd

    def found(self) -> tuple[str, int] | None:
        """After the watch became readable: (name, inode) of the segment the rank holds,
        once it does."""
        try:
            events = os.read(self.fd, 65536)
        except BlockingIOError:
            return None
        names, at = [], 0
        while at + self._EVENT.size <= len(events):
            length = self._EVENT.unpack_from(events, at)[3]
            at += self._EVENT.size
            names.append(events[at:at + length].rstrip(b"\0"))
            at += length
        if not any(name.startswith(SHM_PREFIX.encode()) for name in names):
            return None
        return _held_segment(self.pgid)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _group_members(pgid: int) -> list[int]:
    """The processes of process group ``pgid``: the rank and what it started (a rank run by
    a shell script is the shell's child)."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()  # state, ppid, pgrp, ...
            except (OSError, IndexError):
                continue
            if len(fields) > 2 and int(fields[2]) == pgid:
                members.append(int(entry))
    return members


def _held_segment(pgid: int) -> tuple[str, int] | None:
    """(name, inode) of an MPICH segment a process of group ``pgid`` has open or mapped, if
    any (not one already removed: its path ends in " (deleted)")."""
    prefix = os.path.join(SHM_DIRECTORY, SHM_PREFIX)
    for pid in _group_members(pgid):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith(prefix) and not link.endswith(" (deleted)"):
                    return os.path.basename(link), os.stat(f"/proc/{pid}/fd/{fd}").st_ino
            with open(f"/proc/{pid}/maps", "rb") as f:
                for line in f:
                    fields = line.split(maxsplit=5)
                    path = fields[5].rstrip(b"\n") if len(fields) == 6 else b""
                    if path.startswith(prefix.encode()) and not path.endswith(b" (deleted)"):
                        return os.path.basename(path).decode(), int(fields[4])
        except (OSError, ValueError):  # gone, or closed it meanwhile
            continue
    return None


def _guard_group(pgid: int, status: str) -> None:
    """Forks a guard into the rank's process group that kills the group once this wrapper
    is gone. mpirun kills a failed job's wrappers (Hydra SIGKILLs their groups); the rank
    dies with its parent (PR_SET_PDEATHSIG), but what the rank started would live on, out
    of every group mpirun knows. The guard ignores the signals the group is sent, and learns
    of the wrapper's end from a pipe, not a signal: the group may be sent any signal (a
    scheduler's SIGUSR1 before preemption). It then removes the rank's status file, which a
    killed wrapper never read (and so never removed)."""
    alive, _held = os.pipe()  # the write end stays open in the wrapper until it is gone
    if os.fork() != 0:
        os.close(alive)
        return
    try:
        # Holds no pipe of mpirun's or the rank's, nor the write end.
        os.closerange(0, alive)
        os.closerange(alive + 1, os.sysconf("SC_OPEN_MAX"))
        for sig in signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD}:
            try:
                signal.signal(sig, signal.SIG_IGN)  # whatever the group is sent
            except (OSError, ValueError):
                pass
        os.setpgid(0, pgid)
        while os.read(alive, 1):  # end of file: the wrapper is gone
            pass
        # First: the group's kill ends the guard too. The rank, whose parent is gone, marks
        # nothing more (_mark writes only for the wrapper that started it).
        with contextlib.suppress(OSError):
            os.unlink(status)
        _kill_group(pgid)
    finally:
        os._exit(0)


class _Stream:
    """One of the child's streams forwarded in frames: its partial line, and when the
    line's first and latest pieces arrived."""

    def __init__(self, sink: int, rank: str, token: bytes) -> None:
        self.sink, self.rank, self.token = sink, rank, token
        self.pending = b""
        self.began: float | None = None
        self.last: float | None = None

    def due(self) -> float | None:
        """When the partial line goes out though unfinished (None: there is none)."""
        if self.began is None or self.last is None:
            return None
        return min(self.last + _QUIET_SECONDS, self.began + _PARTIAL_MAX_SECONDS)

    def add(self, chunk: bytes, now: float) -> None:
        data = self.pending + chunk
        cut = _whole_part(data)
        if cut:
            _send_frames(self.sink, self.rank, self.token, data[:cut])
            self.began = None  # what is left is a new partial line
        self.pending = data[cut:]
        if self.pending:
            self.began = now if self.began is None else self.began
            self.last = now
        else:
            self.began = self.last = None

    def flush(self) -> None:
        _send_frames(self.sink, self.rank, self.token, self.pending)
        self.pending, self.began, self.last = b"", None, None


def _forward_output(child: subprocess.Popen, rank: str, token: bytes) -> None:
    """Sends the child's stdout and stderr to ours in frames, live: whole lines and
    carriage-return updates at once, the partial line after them once its stream has been
    quiet for a moment (or has grown for a second). Reports the child's MPICH segment.
    Once the child has exited, kills what it left running: a process it started that holds
    its stdout would otherwise keep the rank's report waiting."""
    selector = selectors.DefaultSelector()
    watch = _SegmentWatch(child.pid)
    if watch.fileno() >= 0 and token:
        selector.register(watch, selectors.EVENT_READ, "watch")
    try:
        selector.register(os.pidfd_open(child.pid), selectors.EVENT_READ, "exited")
    except (OSError, AttributeError):  # Linux before 5.3: its leftovers die after the pipes close
        pass
    streams = {sink: _Stream(sink, rank, token) for sink in (1, 2)}
    selector.register(child.stdout, selectors.EVENT_READ, 1)
    selector.register(child.stderr, selectors.EVENT_READ, 2)
    while any(key.data in streams for key in selector.get_map().values()):
        timeout = min(filter(None, (s.due() for s in streams.values())), default=None)
        events = selector.select(None if timeout is None else max(0.0, timeout - time.monotonic()))
        now = time.monotonic()
        for key, _ in events:
            if key.data == "exited":  # unreaped: the group's id is still the rank's
                selector.unregister(key.fileobj)
                os.close(key.fileobj)
                _kill_group(child.pid)
            elif key.data == "watch":
                _report_segment(selector, watch, rank, token)
            elif chunk := os.read(key.fd, 65536):
                streams[key.data].add(chunk, now)
            else:
                selector.unregister(key.fileobj)
                streams[key.data].flush()
        for stream in streams.values():
            due = stream.due()
            if due is not None and due <= now:
                stream.flush()
    for key in list(selector.get_map().values()):
        if key.data == "exited":
            os.close(key.fileobj)
    watch.close()


def _report_segment(selector: selectors.BaseSelector, watch: _SegmentWatch, rank: str,
                    token: bytes) -> None:
    segment = watch.found()
    if segment is not None:
        selector.unregister(watch)
        watch.close()
        _write_all(2, b"%s%s %s shm %s %d\n" % (FRAME, token, rank.encode(),
                                               segment[0].encode(), segment[1]))


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _whole_part(data: bytes) -> int:
    """How much of ``data`` is whole: up to its last newline, or up to its last carriage
    return that something follows (the progress bar's state before the latest one)."""
    return max(data.rfind(b"\n"), data.rfind(b"\r", 0, len(data) - 1)) + 1


def _send_frames(sink: int, rank: str, token: bytes, data: bytes) -> None:
    """Frames end at a line's end where one fits, so frames of other ranks that arrive in
    between fall between whole lines (only a line longer than a frame is ever cut)."""
    start = 0
    while start < len(data):
        end = min(start + FRAME_PAYLOAD, len(data))
        if end < len(data):
            end = data.rfind(b"\n", start, end) + 1 or end
        payload = data[start:end]
        _write_all(sink, b"%s%s %s %d %d\n%s" % (FRAME, token, rank.encode(), sink,
                                                len(payload), payload))
        start = end


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def main(argv: list[str]) -> int:
    """Runs ``argv`` (after an optional ``--``) as this rank; returns its exit code."""
    command = argv[1:] if argv[:1] == ["--"] else argv
    rank = _rank()
    _announce(rank)
    _die_with_parent(signal.SIGTERM)  # if mpirun's proxy dies, take the rank down too
    status = os.path.join(tempfile.gettempdir(),
                          f"keras-ring-run-{os.getpid()}-{secrets.token_hex(4)}.status")
    with contextlib.suppress(OSError):  # unwritable TMPDIR: the rank marks nothing
        os.close(os.open(status, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    env = dict(os.environ, **{STATUS_ENV: f"{os.getpid()}:{status}"})
    # close_fds=False: the rank must inherit the launcher's descriptors (e.g. Hydra's PMI_FD).
    # Its own process group: Hydra and Open MPI signal ours, gforker only this process, so
    # whatever mpirun does, the rank gets each signal once, from us.
    try:
        # mpirun forwards the launcher's stdin to rank 0; the other ranks read nothing (under
        # plain mpirun, a read there waits forever).
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 stdin=None if rank == "0" else subprocess.DEVNULL,
                                 close_fds=False, env=env, process_group=0,
                                 preexec_fn=lambda: _die_with_parent(signal.SIGKILL))
    except OSError as e:
        _write_all(2, f"[{rank}] keras-ring-run: cannot run {command[0]!r}: {e}\n".encode())
        return _report(rank, 127, _marks(status))

    def forward(signum, frame) -> None:
        try:  # to the rank's group: its own children (data loader workers) too
            os.killpg(child.pid, signum)
        except ProcessLookupError:
            pass

    for sig in _FORWARDED_SIGNALS:
        signal.signal(sig, forward)
    try:
        _guard_group(child.pid, status)
    except OSError:  # no fork: what the rank starts may outlive a killed job
        pass
    _forward_output(child, rank, os.environ.get(TOKEN_ENV, "").encode())
    # Unreaped, the rank keeps its pid, so the group's id cannot be reused while what the
    # rank left running (and the guard) is killed.
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
    _kill_group(child.pid)
    code = child.wait()
    return _report(rank, code if code >= 0 else 128 - code, _marks(status))


def _announce(rank: str) -> None:
    """Tells the launcher this rank began (a frame it consumes): a rank that never sent it
    was never launched (a host mpirun could not reach)."""
    token = os.environ.get(TOKEN_ENV)
    if token:
        _write_all(2, b"%s%s %s start\n" % (FRAME, token.encode(), rank.encode()))


def _report(rank: str, code: int, marks: tuple[bytes, ...] = ()) -> int:
    """Tells the launcher how this rank ended (a frame it consumes), returns ``code``."""
    token = os.environ.get(TOKEN_ENV)
    if token:
        _write_all(2, b"%s%s %s exit %d%s\n" % (FRAME, token.encode(), rank.encode(), code,
                                                 b"".join(b" " + m for m in marks)))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
