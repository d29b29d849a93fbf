"""The errors a launch raises, importable without TensorFlow.

The bootstrap, the rendezvous and the launchers raise these before TensorFlow is loaded (or
in processes that never load it), so they live apart from the collective errors, which
subclass ``tf.errors`` classes. ``keras_ring.errors`` re-exports them: that is their public
home, and their ``__module__`` says so, so tracebacks and pickles name ``keras_ring.errors``.
"""

from __future__ import annotations

import functools

import re
from dataclasses import dataclass

# "keras_ring: allreduce 'x' ..." or, for a collective refused after an earlier failure,
# "keras_ring: cannot run allreduce 'x' because ...": the collective is the one called.
_LABEL = re.compile(r"keras_ring: (?:cannot run )?(?P<collective>\w+ (?:'[^']*'|#\d+))")
_RANK = re.compile(r"\brank (?P<rank>\d+)\b")
# "... failed on rank R: <cause>" names the reporting rank; the cause names the rank it is about.
_REPORTER = re.compile(r"^.*\bfailed on rank \d+: ", re.S)
# "rank R: ..." at the start names the rank that reports, not the one at fault.
_REPORTING_RANK = re.compile(r"^rank \d+: ")
# "rank 0 has X, rank N has Y": rank 0 is the reference, N the one that diverged.
_DIVERGING = re.compile(r"\brank 0 has .*?, rank (?P<rank>\d+) has ", re.S)

_PUBLIC_MODULE = "keras_ring.errors"


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


# Set after the class is made: dataclass resolves the annotations in the module it names.
ErrorInfo.__module__ = _PUBLIC_MODULE


class KerasRingError(Exception):
    """Base of every keras_ring error.

    Attributes:
        collective: the failing collective, e.g. ``"allreduce 'grad_dense_1'"``, or None.
        rank: the rank the error is about (dead, waited for, or diverging), or None.
        reason: the message without the collective prefix.
    """

    __module__ = _PUBLIC_MODULE
    # Raised while a tf.function traces: autograph passes it on as it is, where it would
    # make a new one from the message, without the attributes below.
    ag_pass_through = True
    collective: str | None = None
    rank: int | None = None
    reason: str = ""

    def _set(self, info: ErrorInfo) -> None:
        self.collective = info.collective or None
        self.rank = info.rank if info.rank >= 0 else None
        self.reason = info.reason

    @classmethod
    def about(cls, rank: int | None, message: str):
        """The error with ``message`` (``"keras_ring: ..."``), about ``rank``: a check of
        the ranks' agreement found it, on every rank, in Python."""
        error = cls(message)
        error.rank, error.reason = rank, message.removeprefix("keras_ring: ")
        return error

    def _describe(self, message: str) -> None:
        """Reads the attributes from a message: only for errors that reached Python without
        their structure (keras_ring.errors.error_info)."""
        message = _REPORTING_RANK.sub("", message, count=1)
        m = _LABEL.search(message)
        self.collective = m.group("collective") if m else None
        self.reason = message[m.end():].lstrip(": ") if m else message
        cause = _REPORTER.sub("", self.reason)
        r = _DIVERGING.search(cause) or _RANK.search(cause)
        self.rank = int(r.group("rank")) if r else None


class NotInitializedError(KerasRingError, ValueError):
    """A keras_ring function was called before ``keras_ring.init()``, after ``shutdown()``,
    or in a process forked from a rank (whose runtime is its parent's)."""

    __module__ = _PUBLIC_MODULE

    def __init__(self, what: str = "this function", *, message: str | None = None):
        super().__init__(message or
                         f"keras_ring has not been initialized: call keras_ring.init() before {what}")

    def __reduce__(self):
        # Rebuilt from its whole message (a data loader's worker process sends it pickled):
        # the default passes the message as ``what``, inside another sentence.
        return functools.partial(type(self), message=str(self)), ()


class InitError(KerasRingError, RuntimeError):
    """``keras_ring.init()`` could not bootstrap or connect the ranks.

    Args:
        message: what went wrong.
        rank: the rank at fault when known.
        info: the core's structure of the error, when it reported one; otherwise the rank
            is read from the message.
    """

    __module__ = _PUBLIC_MODULE

    def __init__(self, message: str, rank: int | None = None, info: ErrorInfo | None = None):
        super().__init__(message)
        self._describe(message)
        if info is not None:
            self._set(info)
        if rank is not None:
            self.rank = rank
