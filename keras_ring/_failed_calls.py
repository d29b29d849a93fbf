"""What a failed ``fit``, ``evaluate`` or ``predict`` held, its ``tf.data`` iterators among
it, is freed as the next such call starts, never by a garbage collection mid-collective.

The error's frames keep the iterator in a reference cycle until a full garbage collection,
at any later moment. Its destructor waits for TensorFlow's autotune thread, which on a busy
machine often misses its wake-up and sleeps out its optimization period (doubling with the
iterator's age, up to 60 s; ``benchmarks/iterator_teardown.py``): one rank stalled
mid-collective, and every peer with it, tests after the failure. Freed at once instead, the
wait would delay the failure itself (a peer learns of it later; a handler may meet the
failure exit's grace). So the failure only moves what the frames hold into
``RUNTIME.held_after_failure``, which costs nothing, and the next call frees it on every
rank before its first collective, after one call's worth of aging. A process that ends after
the failure frees it at exit, as before.

What is moved: the locals of the Keras, TensorFlow and keras_ring frames of the error's
tracebacks (with their callers up to the failed call, and its context's and cause's). The
program's own frames keep theirs for a debugger; Keras and TensorFlow hide their frames from
tracebacks anyway.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Iterator
from types import FrameType

from keras_ring import _keras_private
from keras_ring.runtime import RUNTIME

_HOOKED = ("fit", "evaluate", "predict")


def install() -> None:
    """Wraps ``Model.fit``, ``evaluate`` and ``predict`` (where the classes define them)."""
    import keras

    for name in _HOOKED:
        owner = next(klass for klass in keras.Model.__mro__ if name in vars(klass))
        original = getattr(owner, name)
        if getattr(original, "_keras_ring_releases", False):
            continue
        setattr(owner, name, _releasing(original))


def _releasing(original):
    @functools.wraps(original)
    def call(*args, **kwargs):
        release_held()
        try:
            return original(*args, **kwargs)
        except BaseException as error:
            try:
                hold(error, stop_at=sys._getframe())
            except Exception:  # noqa: BLE001  never in place of the program's own error
                pass
            raise

    call._keras_ring_releases = True
    return call


def release_held() -> None:
    """Frees what failed calls left (the ``tf.data`` iterators' teardown waits happen here)."""
    held = RUNTIME.held_after_failure
    if held:
        try:
            _keras_private.reset_epoch_iterators(held)
        except Exception:  # noqa: BLE001  freeing is best effort, never the call's failure
            pass
        finally:
            held.clear()


def hold(error: BaseException, stop_at: FrameType) -> None:
    """Moves what the library frames of ``error`` hold into ``RUNTIME.held_after_failure``
    (see the module's docstring)."""
    import keras
    import tensorflow as tf

    roots = (*(os.path.dirname(module.__file__) + os.sep for module in (keras, tf)),
             os.path.dirname(os.path.abspath(__file__)) + os.sep)  # keras_ring's own
    for frame in _frames_of(error, stop_at):
        if not frame.f_code.co_filename.startswith(roots):
            continue
        RUNTIME.held_after_failure.extend(_keras_private.fit_leftovers(frame.f_locals.values()))
        try:
            frame.clear()
        except RuntimeError:  # still running: not one of the failed call's
            pass
        frame.f_locals  # noqa: B018  read again: empties the snapshot the first read made


def _frames_of(error: BaseException, stop_at: FrameType) -> Iterator[FrameType]:
    """Each frame of ``error``'s tracebacks, its context's and its cause's, and their callers
    up to (not including) ``stop_at``, once."""
    seen: set[int] = set()
    chained = [error]
    while chained:
        exception = chained.pop()
        if id(exception) in seen:
            continue
        seen.add(id(exception))
        chained.extend(e for e in (exception.__context__, exception.__cause__) if e is not None)
        traceback = exception.__traceback__
        while traceback is not None:
            frame = traceback.tb_frame
            while frame is not None and frame is not stop_at and id(frame) not in seen:
                seen.add(id(frame))
                yield frame
                frame = frame.f_back
            traceback = traceback.tb_next
