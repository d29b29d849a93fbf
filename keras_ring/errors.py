"""keras_ring's exceptions.

Errors raised by collectives are subclasses of the matching ``tf.errors`` class, so code that
catches TensorFlow's errors keeps working, and they carry what failed as attributes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import tensorflow as tf

from keras_ring.ops.loader import describe_error

# "keras_ring: allreduce 'x' ..." or, for a collective refused after an earlier failure,
# "keras_ring: cannot run allreduce 'x' because ...": the collective is the one called.
_LABEL = re.compile(r"keras_ring: (?:cannot run )?(?P<collective>\w+ (?:'[^']*'|#\d+))")
# TensorFlow's decorations after our message: " [[{{node ...}}]]", " [Op:...] name: ...".
_TF_SUFFIX = re.compile(r"\s*(?:\[\[\{\{node |\[Op:).*$", re.S)
# Where our message starts (in graph errors it follows TensorFlow's "Detected at node"
# traceback, whose file paths contain "keras_ring" too).
_OURS = re.compile(r"keras_ring(?:: | has not been initialized)")
_RANK = re.compile(r"\brank (?P<rank>\d+)\b")
# "... failed on rank R: <cause>" names the reporting rank; the cause names the rank it is about.
_REPORTER = re.compile(r"^.*\bfailed on rank \d+: ", re.S)
# "rank R: ..." at the start names the rank that reports, not the one at fault.
_REPORTING_RANK = re.compile(r"^rank \d+: ")
# TensorFlow's function runtime replaces some codes: "... originally returned UnavailableError,
# and was replaced by InternalError ...": the original tells what happened.
_REPLACED = re.compile(r"originally returned (?P<name>\w+Error)")
# "rank 0 has X, rank N has Y": rank 0 is the reference, N the one that diverged.
_DIVERGING = re.compile(r"\brank 0 has .*?, rank (?P<rank>\d+) has ", re.S)


class KerasRingError(Exception):
    """Base of every keras_ring error.

    Attributes:
        collective: the failing collective, e.g. ``"allreduce 'grad_dense_1'"``, or None.
        rank: the rank the error is about (dead, waited for, or diverging), or None.
        reason: the message without the collective prefix.
    """

    collective: str | None = None
    rank: int | None = None
    reason: str = ""

    def _set(self, info: "ErrorInfo") -> None:
        self.collective = info.collective or None
        self.rank = info.rank if info.rank >= 0 else None
        self.reason = info.reason

    def _describe(self, message: str) -> None:
        """Reads the attributes from a message: only for errors that reached Python without
        their structure (see ``error_info``)."""
        message = _REPORTING_RANK.sub("", message, count=1)
        m = _LABEL.search(message)
        self.collective = m.group("collective") if m else None
        self.reason = message[m.end():].lstrip(": ") if m else message
        cause = _REPORTER.sub("", self.reason)
        r = _DIVERGING.search(cause) or _RANK.search(cause)
        self.rank = int(r.group("rank")) if r else None


class NotInitializedError(KerasRingError, ValueError):
    """A keras_ring function was called before ``keras_ring.init()`` or after ``shutdown()``."""

    def __init__(self, what: str = "this function"):
        super().__init__(
            f"keras_ring has not been initialized: call keras_ring.init() before {what}"
        )


class InitError(KerasRingError, RuntimeError):
    """``keras_ring.init()`` could not bootstrap or connect the ranks.

    Args:
        message: what went wrong.
        rank: the rank at fault when known; otherwise read from the message.
    """

    def __init__(self, message: str, rank: int | None = None, info: "ErrorInfo | None" = None):
        super().__init__(message)
        self._describe(message)
        if info is not None:
            self._set(info)
        if rank is not None:
            self.rank = rank


class CollectiveMismatchError(KerasRingError, tf.errors.FailedPreconditionError):
    """Ranks submitted different collectives (shape, dtype, op, root or name differ)."""


class CollectiveArgumentError(KerasRingError, tf.errors.InvalidArgumentError):
    """A collective's argument is invalid on some rank (e.g. a root rank out of range)."""


class CollectiveTimeoutError(KerasRingError, tf.errors.DeadlineExceededError):
    """A peer did not take part within ``KERAS_RING_TIMEOUT_SECONDS``."""


class PeerFailureError(KerasRingError, tf.errors.UnavailableError):
    """A peer process is gone (exited, crashed, killed) or its connection broke."""


class CollectiveAbortedError(KerasRingError, tf.errors.AbortedError):
    """The runtime was aborted (an earlier failure, or shutdown) while the collective waited."""


_BY_TF_CLASS = [
    (tf.errors.FailedPreconditionError, CollectiveMismatchError),
    (tf.errors.InvalidArgumentError, CollectiveArgumentError),
    (tf.errors.DeadlineExceededError, CollectiveTimeoutError),
    (tf.errors.UnavailableError, PeerFailureError),
    (tf.errors.AbortedError, CollectiveAbortedError),
    (tf.errors.CancelledError, CollectiveAbortedError),
]
# The core's status codes (common.h), numbered like TensorFlow's.
_BY_CODE = {9: CollectiveMismatchError, 3: CollectiveArgumentError, 4: CollectiveTimeoutError,
            14: PeerFailureError, 10: CollectiveAbortedError, 1: CollectiveAbortedError}

@dataclass(frozen=True)
class ErrorInfo:
    """An error's structure as the core reports it: code, the rank at fault (-1: none), the
    collective (empty: none) and the reason, without the collective's prefix."""

    code: int
    rank: int
    collective: str
    reason: str

    @classmethod
    def parse(cls, text: bytes | str) -> "ErrorInfo | None":
        """``"code\\nrank\\ncollective\\nreason"`` (the core's encoding), or None."""
        if isinstance(text, bytes):
            text = text.decode(errors="replace")
        parts = text.split("\n", 3)
        if len(parts) != 4 or not parts[0].lstrip("-").isdigit():
            return None
        try:
            return cls(int(parts[0]), int(parts[1]), parts[2], parts[3])
        except ValueError:
            return None


def error_info(message: str) -> ErrorInfo | None:
    """The structure the core reported for the error with this message: TensorFlow hands
    Python only codes and messages, so the op library remembers each error's structure."""
    return ErrorInfo.parse(describe_error(message))


def translate(error: tf.errors.OpError) -> Exception:
    """Maps a TensorFlow error raised by a keras_ring op to keras_ring's class for it."""
    start = _OURS.search(error.message)
    if start is None:
        return error
    message = _TF_SUFFIX.sub("", error.message[start.start():]).strip()
    if "has not been initialized" in message:
        return NotInitializedError("running a collective")
    info = error_info(message)
    if info is not None and info.code in _BY_CODE:
        err = _BY_CODE[info.code](error.node_def, error.op, message)
        err._set(info)
        return err
    replaced = _REPLACED.search(error.message)
    original = getattr(tf.errors, replaced["name"], None) if replaced else None
    for tf_class, ours in _BY_TF_CLASS:
        if isinstance(error, tf_class) or original is tf_class:
            err = ours(error.node_def, error.op, message)
            err._describe(message)
            return err
    return error


def is_interrupt_clash(error: RuntimeError) -> bool:
    """Ctrl-C while a collective waits: the op fails ("interrupted by SIGINT") while Python's
    KeyboardInterrupt is pending; it fires as TensorFlow builds its exception, and pybind11
    reports the clash as "RuntimeError: ... MISMATCH ... REPLACED BY KeyboardInterrupt". The
    program should get the KeyboardInterrupt it expects (so ``except KeyboardInterrupt``
    works and the traceback says what happened)."""
    return "REPLACED BY KeyboardInterrupt" in str(error)


def install_tensorflow_hook() -> None:
    """Makes a keras_ring op's error one of keras_ring's classes wherever a graph runs it:
    ``tf.function``, ``fit``, ``evaluate``, ``predict``, ``train_on_batch``. TensorFlow runs
    every graph function through ``Context.call_function`` and raises its classes there
    (from C++, by status code); that method is wrapped once. Other errors pass untouched.
    Eager calls are translated by ``collectives`` itself.
    """
    from tensorflow.python.eager import context

    original = context.Context.call_function
    if getattr(original, "_keras_ring", False):
        return

    def call_function(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        except tf.errors.OpError as e:
            translated = translate(e)
            if translated is e:
                raise
            raise translated.with_traceback(e.__traceback__) from None
        except RuntimeError as e:
            if is_interrupt_clash(e):
                raise KeyboardInterrupt from None
            raise

    call_function._keras_ring = True
    context.Context.call_function = call_function
