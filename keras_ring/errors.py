"""keras_ring's exceptions.

Errors raised by collectives are subclasses of the matching ``tf.errors`` class, so code that
catches TensorFlow's errors keeps working, and they carry what failed as attributes.
"""

from __future__ import annotations

import re

import tensorflow as tf

# The errors of a launch need no TensorFlow (launchers raise them): defined there, public here.
from keras_ring._errors_base import ErrorInfo, InitError, KerasRingError, NotInitializedError
from keras_ring.ops.loader import describe_error

__all__ = [
    "KerasRingError", "NotInitializedError", "InitError", "CollectiveMismatchError",
    "CollectiveArgumentError", "CollectiveTimeoutError", "PeerFailureError",
    "CollectiveAbortedError", "WeightMismatchError", "ErrorInfo", "error_info", "translate", "for_status_code",
    "is_interrupt_clash", "install_tensorflow_hook",
]

# TensorFlow's decorations after our message: " [[{{node ...}}]]", " [[{{function_node
# ...}}{{node ...}}]]", " [Op:...] name: ...".
_TF_SUFFIX = re.compile(r"\s*(?:\[\[\{\{|\[Op:).*$", re.S)
# Where our message starts (in graph errors it follows TensorFlow's "Detected at node"
# traceback, whose file paths contain "keras_ring" too).
_OURS = re.compile(r"keras_ring(?:: | has not been initialized)")
# TensorFlow's function runtime replaces some codes: "... originally returned UnavailableError,
# and was replaced by InternalError ...": the original tells what happened.
_REPLACED = re.compile(r"originally returned (?P<name>\w+Error)")
# In the core's error for a collective in a process forked from a rank (runtime.cc).
FORKED = "after keras_ring.init(), e.g. by a multiprocessing pool"


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


class LearningRateMismatchError(KerasRingError, ValueError):
    """The ranks train with different learning rates: a callback set the rate from one
    rank's own metrics (``ReduceLROnPlateau`` without ``MetricAverageCallback``)."""


class OptimizerMismatchError(KerasRingError, ValueError):
    """The ranks' optimizers differ in a setting other than the learning rate (momentum,
    clipnorm, weight_decay, ...): they would apply the same averaged gradients differently."""


class EpochMismatchError(KerasRingError, ValueError):
    """The ranks begin ``fit`` at different epochs: a checkpoint restored on some ranks only
    (``BackupAndRestore`` on rank 0 alone), or ``initial_epoch`` passed differently."""


# In every weight check's message (keras_ring._weight_check.TEMPLATE), and the first rank
# whose weights differ from the first rank's.
WEIGHTS_DIFFER = "the ranks are training different models"
_ODD_RANK = re.compile(r"and rank\(s\) (?P<rank>\d+)")
# The weight check's collective (keras_ring._weight_check): a custom step compares where it
# gets a list of variables it has not seen, so ranks whose lists differ part there.
WEIGHT_CHECK = "keras_ring.weight_check"
_WEIGHT_CHECK_HINT = (
    ". The weight check ran on some ranks only: it runs where a step passes a list of "
    "variables it has not seen before, so the ranks' lists differ (a layer frozen or "
    "unfrozen on some ranks only, a model or optimizer made again on some ranks), or the "
    "ranks reached a new list at different steps (uneven data shards): set the trainable "
    "flags alike on every rank, at the same step")

# train_on_batch's rate check (keras_ring._rate_check.BatchRates): a rank that changed its
# rate alone compares, and its peers train.
RATE_CHECK = "keras_ring.rate_check.train_on_batch"
_RATE_CHECK_HINT = (
    ". The learning rate check of train_on_batch ran on some ranks only: it runs where a "
    "call finds the rate changed since the last one, so the program set the rate on some "
    "ranks only (from this rank's own loss, or in code that runs on some ranks only): set "
    "it alike on every rank, from values every rank shares (keras_ring.allreduce of the "
    "loss)")
# fit's last rate check (keras_ring._rate_check.RateCheck.on_train_end): a rank whose fit
# ended early compares, and its peers train.
TRAIN_END = "keras_ring.rate_check.train_end"
_TRAIN_END_HINT = (
    ". The fit ended on some ranks only, the others went on training: a callback stopped "
    "training from this rank's own metrics (EarlyStopping, or one that sets "
    "model.stop_training: put keras_ring.callbacks.MetricAverageCallback() before it), or "
    "the ranks' data ran out at different steps (give every rank the same number of steps)")
# The hint for a mismatch where a check's collective met another (see each).
_MISMATCH_HINTS = {WEIGHT_CHECK: _WEIGHT_CHECK_HINT, RATE_CHECK: _RATE_CHECK_HINT,
                   TRAIN_END: _TRAIN_END_HINT}
# MetricAverageCallback's allreduce at each epoch's end, named by the metrics it averages.
METRIC_AVERAGE = "MetricAverage["
_METRIC_AVERAGE_OPERATION_HINT = (
    ". An epoch ended on some ranks while the others went on training: a callback ended it "
    "from this rank's own batch values (TerminateOnNaN, or one that sets "
    "model.stop_training within an epoch), or the ranks' data ran out at different steps "
    "(give every rank the same number of steps)")
_METRIC_AVERAGE_NAME_HINT = (
    ". The ranks logged different metrics at this epoch's end: validation data (or "
    "validation_freq, validation_split) given on some ranks only, or models compiled with "
    "different metrics: give every rank the same")
# The first collective of keras_ring.elastic.run's state sync (keras_ring._bucket_tuning).
ELASTIC_SYNC = "keras_ring.bucket_tuning.kept"
_ELASTIC_SYNC_HINT = (
    ". Some ranks began keras_ring.elastic.run's state sync (a worker joined or left) while "
    "others ran another collective: in each new world a worker that joins must reach the "
    "function @keras_ring.elastic.run wraps before any other collective. A training step "
    "run before it (Horovod's tensorflow2_synthetic_benchmark_elastic.py runs one to build "
    "its weights) meets the survivors' sync there: build the weights without collectives "
    "instead (model(x) or model.build(shape), and optimizer.build(model.trainable_variables)), "
    "or run that step inside the wrapped function")
# A collective built in a tf.cond or tf.while_loop body carries its place in its name
# (keras_ring.ops.wrappers._place): ranks that met it in different places diverged there.
_PLACE_HINT = (
    ". The ranks reached this collective in different places of a function's control flow: "
    "a loop (tf.while_loop, or a Python loop over tensors in a tf.function) that ran more "
    "times on some ranks, or a branch (tf.cond, or a Python if on a tensor) taken "
    "differently by data. Run the same collectives in the same order on every rank: the "
    "same number of iterations (e.g. the ranks' largest count, keras_ring.allreduce with "
    "op=keras_ring.Max), and collectives outside branches that depend on a rank's data")

# An unnamed collective built in a graph also says which of its function's unnamed
# collectives it is (keras_ring.ops.wrappers._place): ranks in one place that met different
# ones are out of step within a function.
_UNNAMED_PLACE = re.compile(r"'\(in ([^']*), unnamed collective \d+\)'")
_ORDER_HINT = (
    ". The ranks met different unnamed collectives of one function (numbered in the order "
    "the function builds them): a loop before this one ran more times on some ranks, or a "
    "run of the function failed on some ranks after some of its collectives had run and "
    "the program caught the error and went on (that rank's next run then meets the others' "
    "later collectives). Run the same collectives in the same order on every rank; a step "
    "that has run collectives cannot be skipped or retried on some ranks alone: let its "
    "error end the job, or decide on every rank before the step (a bad batch: allreduce a "
    "flag with op=keras_ring.Max and skip it everywhere)")


class WeightMismatchError(KerasRingError, ValueError):
    """The ranks hold different weights of a model they train together (its initial weights
    were never broadcast, or a checkpoint was restored on some ranks only)."""

    layout = False  # True: the ranks train different weights, which no broadcast mends


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
    if FORKED in message:  # before the next: a fork's message may say both
        return NotInitializedError(message=message)
    if "has not been initialized" in message:
        return NotInitializedError("running a collective")
    if WEIGHTS_DIFFER in message:
        return _weight_mismatch(message)
    info = error_info(message)
    if info is not None and info.code in _BY_CODE:
        return _ours(_BY_CODE[info.code], message, error.node_def, error.op)
    replaced = _REPLACED.search(error.message)
    original = getattr(tf.errors, replaced["name"], None) if replaced else None
    for tf_class, ours in _BY_TF_CLASS:
        if isinstance(error, tf_class) or original is tf_class:
            return _ours(ours, message, error.node_def, error.op)
    return error


def _weight_mismatch(message: str) -> WeightMismatchError:
    """The error of a traced step's weight check (keras_ring._step_check): TensorFlow's
    Assert printed its text in brackets, quotes escaped."""
    text = message.removesuffix("]").replace("\\'", "'")
    odd = _ODD_RANK.search(text)
    return WeightMismatchError.about(int(odd["rank"]) if odd else None, text)


def for_status_code(code: int, message: str) -> KerasRingError:
    """keras_ring's error for a status code the C API returned (a barrier's, say)."""
    for tf_class, ours in _BY_TF_CLASS:
        if code == tf_class(None, None, "").error_code:
            return _ours(ours, message)
    return KerasRingError(message)


def _ours(cls: type, message: str, node_def=None, op=None) -> KerasRingError:
    # A check's name may carry a place (" (in tf.cond true branch)"): matched up to it.
    hint = next((h for name, h in _MISMATCH_HINTS.items()
                 if "operation mismatch" in message and f"'{name}" in message), "")
    if not hint and "name mismatch" in message and f"'{TRAIN_END}'" in message:
        hint = _TRAIN_END_HINT  # an epoch's end met the next epoch's rate check
    if not hint and "mismatch" in message and f"'{ELASTIC_SYNC}" in message:
        hint = _ELASTIC_SYNC_HINT
    if not hint and f"'{METRIC_AVERAGE}" in message:
        hint = (_METRIC_AVERAGE_OPERATION_HINT if "operation mismatch" in message else
                _METRIC_AVERAGE_NAME_HINT if "name mismatch" in message else "")
    if not hint and "name mismatch" in message and "(in tf." in message:
        places = _UNNAMED_PLACE.findall(message)
        hint = _ORDER_HINT if len(places) > 1 and len(set(places)) == 1 else _PLACE_HINT
    err = cls(node_def, op, message + hint)
    info = error_info(message)
    if info is not None:
        err._set(info)
    else:  # not an error the library reported: its message is all there is
        err._describe(message)
    err.reason += hint
    return err


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
