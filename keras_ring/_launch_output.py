"""The launcher's side of the frames ``_rank_wrapper`` sends: splits mpirun's merged output
into the ranks' frames and writes their bytes with ``[rank] `` prefixes, so two ranks never
share a line. Also used by the elastic driver for its workers' output."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import select
import threading

from keras_ring._rank_wrapper import FRAME, MARKS


class Screen:
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

    def __init__(self, out, screen: Screen | None = None) -> None:
        self.out = out
        self.screen = screen or Screen()
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


class Sink:
    """The launcher's stdout or stderr as bytes. When its reader has gone (a broken pipe), or
    it cannot be written at all (a full disk, ``/dev/full``, a descriptor closed before the
    launcher began), it says so once, through ``on_reader_gone`` or ``on_write_error(error)``,
    and then drops what it is given: the job's output must keep flowing, or the ranks and
    mpirun would block writing it, for ever."""

    def __init__(self, stream, on_reader_gone, on_write_error) -> None:
        self.out = getattr(stream, "buffer", stream)  # None: the descriptor was closed
        self.on_reader_gone = on_reader_gone
        self.on_write_error = on_write_error
        self.gone = False

    def write(self, data: bytes) -> None:
        if self.gone:
            return
        try:
            if self.out is None:
                raise OSError(errno.EBADF, "closed before keras-ring-run began")
            self._write_all(data)
        except OSError as error:
            self.gone = True
            # Python would try the unwritten bytes again at exit and complain.
            with contextlib.suppress(OSError, ValueError, AttributeError):
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, self.out.fileno())
                os.close(devnull)
            if isinstance(error, BrokenPipeError):
                self.on_reader_gone()
            else:
                self.on_write_error(error)

    def _write_all(self, data: bytes) -> None:
        try:
            fd = self.out.fileno()
        except (AttributeError, ValueError, OSError):  # not a file: as it is
            self.out.write(data)
            self.out.flush()
            return
        self.out.flush()  # anything written through the stream before
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(fd, view):]
            except BlockingIOError:  # a non-blocking stdout (a CI runner's): wait for room
                select.select([], [fd], [])

    def flush(self) -> None:
        pass  # write() flushed


def same_file(a, b) -> bool:
    try:
        sa, sb = os.fstat(a.fileno()), os.fstat(b.fileno())
    except (OSError, ValueError, AttributeError):  # closed, or not a real file
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


class FrameReader:
    """Splits the merged output of mpirun into the ranks' frames (see ``_rank_wrapper``)."""

    def __init__(self, token: bytes, renderer: Renderer, on_exit, on_start=None,
                 on_segment=None) -> None:
        self.token, self.renderer, self.on_exit = token, renderer, on_exit
        self.on_start = on_start or (lambda rank: None)
        self.on_segment = on_segment or (lambda name, inode: None)
        self.buffer = b""

    def feed(self, chunk: bytes) -> None:
        self.buffer += chunk
        while self.buffer:
            start = self.buffer.find(FRAME)
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
            fields = self.buffer[len(FRAME):end].split()
            if len(fields) == 3 and fields[0] == self.token and fields[2] == b"start":
                self.buffer = self.buffer[end + 1:]
                self.on_start(int(fields[1]) if fields[1].isdigit() else -1)
                continue
            if (len(fields) == 5 and fields[0] == self.token and fields[2] == b"shm"
                    and fields[4].isdigit()):
                self.buffer = self.buffer[end + 1:]
                self.on_segment(fields[3].decode(errors="replace"), int(fields[4]))
                continue
            if (len(fields) >= 4 and fields[0] == self.token and fields[2] == b"exit"
                    and set(fields[4:]) <= set(MARKS)):
                self.buffer = self.buffer[end + 1:]
                self.on_exit(int(fields[1]) if fields[1].isdigit() else -1, int(fields[3]),
                             b"follows" in fields[4:], b"stalled" in fields[4:])
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
        for k in range(min(len(FRAME) - 1, len(self.buffer)), 0, -1):
            if FRAME.startswith(self.buffer[-k:]):
                return len(self.buffer) - k
        return len(self.buffer)

    def close(self) -> None:
        self.renderer.raw(self.buffer)
        self.buffer = b""
        self.renderer.close()
