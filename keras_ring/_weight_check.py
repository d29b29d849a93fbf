"""Every rank trains the same model: a check that the ranks' weights (trainable, and frozen:
made trainable, now ``trainable=False``) agree when ``fit`` or ``train_on_batch`` starts
training a model, after each ``init()``, and a digest of them that ``fit``'s epoch check
compares at each epoch's end (``_rate_check``).

Ranks that start from different weights (no ``BroadcastGlobalVariablesCallback``, a
checkpoint restored on one rank only) never fail by themselves: the averaged gradients move
every rank's weights alike, so the difference stays for good, and the model saved from rank
0 is one of several that trained.

The weights are compared before the first step, after the callbacks' broadcast, where equal
weights are equal to the bit: per-weight fingerprints (the sum of the weight's bit patterns
as unsigned integers, exact in any order, so equal weights give equal fingerprints whatever
the thread count, host or kernel that sums them). Where they differ, the verdict waits for
the second step: a program that broadcasts after its first batch (Horovod's older callback
did) has mended them by then, to the bit again. An epoch that ends first (a fit of one step)
compares them again and warns where they still differ (``_Checker.settle``). The
fingerprints follow tags that say which weights they are (``_weight_layout``): ranks that
train different weights fail at once. One
allgather of two int64 per weight, rarely two; nothing is added to the training step's graph.

Each later ``fit`` compares again as it begins: between fits a program may change the weights
on some ranks only (a checkpoint loaded on rank 0, ``EarlyStopping(restore_best_weights=True)``
restoring each rank's own best epoch). Updates need not be bit-identical across ranks (a GPU's
atomic scatter-adds), so there weights whose fingerprints differ are compared by value: the
root broadcasts them, and a difference beyond ``LATER_TOLERANCE`` of the weight's scale fails.
The ranks apply the same averaged gradients, so rounding differences do not grow by training.
"""

from __future__ import annotations

import hashlib
import threading
import warnings
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from keras_ring import _keras_private
from keras_ring._grouping import variable_keys
from keras_ring._weight_layout import SHOWN, Layout, ModelLayout, label, row, split_rows
from keras_ring.collectives import allgather, broadcast
from keras_ring.errors import WEIGHT_CHECK, WEIGHTS_DIFFER, WeightMismatchError
from keras_ring.ops.wrappers import collectives_made
from keras_ring.process_sets import ProcessSet, global_process_set
from keras_ring.runtime import RUNTIME

_INSTALLED = "_keras_ring_weight_check"
NAME = WEIGHT_CHECK  # the collective's name, seen in errors beside the other side's
# Largest difference, relative to the weight's largest magnitude, that a later fit tolerates:
# rounding differences of updates grow like the square root of the steps, about 1e-4 after
# a million; weights restored from another epoch differ by far more.
LATER_TOLERANCE = 1e-3

_UNKNOWN = object()
_fit_step = threading.local()


def in_checked_fit_step() -> bool:
    """Whether a model's training function that this module checks is running (or tracing)."""
    return getattr(_fit_step, "checked", False)


Settings = Callable[[], "tuple[set[int], ProcessSet] | None"]


class _Checker:
    """One model's check: where it stands since the last ``init()``."""

    def __init__(self, model: Any, settings: Settings) -> None:
        self.model = model
        self.settings = settings
        self.generation: int | None = None
        self.steps_done = 0
        self.differed_at: int | None = None  # steps done when a comparison first differed
        self.passed = False
        self.later = False  # the weights compared equal and trained since: compare by value
        self.warned = False  # settle() warned of weights that still differ
        self.current: Any = _UNKNOWN  # settings() for the present training function
        # Whether the present training function's first step made a collective (it was
        # traced, or ran eagerly, then); None until that step ran.
        self.communicates: bool | None = None

    def new_fit(self) -> None:
        """A ``fit`` begins: compare again before its first step (see above)."""
        if self.passed and self.generation == RUNTIME.generation:
            self.passed, self.differed_at, self.later = False, None, True

    def new_function(self) -> None:
        """Keras made a new training function (compile, or fit after it): the optimizers
        that train the model may be others now."""
        self.current, self.communicates = _UNKNOWN, None

    def present_settings(self) -> Any:
        """settings() for the present training function, asked once per function."""
        if self.current is _UNKNOWN:
            self.current = self.settings()
        return self.current

    def before_step(self) -> None:
        if self.generation != RUNTIME.generation:
            self.generation, self.steps_done = RUNTIME.generation, 0
            self.differed_at, self.passed, self.later = None, False, False
            self.warned = False
        if self.passed or not RUNTIME.config.check_weights:
            return
        if self.present_settings() is None:  # no keras_ring optimizer: each rank trains alone
            return
        if _keras_private.unbuilt_layers(self.model):
            return  # weights still to be made: compare when the first step has made them
        mismatch = compare_weights(self.model, *self.current, later=self.later)
        if mismatch is None:
            self.passed = True
        elif mismatch.layout:  # no broadcast mends it
            raise mismatch
        elif self.differed_at is None:
            self.differed_at = self.steps_done  # a broadcast after this step may mend it
        elif self.steps_done > self.differed_at:
            raise mismatch

    def after_step(self) -> None:
        self.steps_done += 1

    def settle(self) -> None:
        """An epoch ended with a verdict that waits for the second step (a fit of one step has
        none): a broadcast after the first batch has mended the weights by now, so where they
        still differ every rank warns. Not an error: a program may mend them before it trains
        again (Horovod's elastic Keras example fits one step to make the optimizer's state,
        then copies rank 0's), and the next step raises if it did not. Every rank calls this
        alike (the comparison said the same there)."""
        if (self.differed_at is None or self.passed or self.warned
                or self.generation != RUNTIME.generation
                or self.steps_done <= self.differed_at or not RUNTIME.config.check_weights):
            return
        if self.present_settings() is None:
            return
        mismatch = compare_weights(self.model, *self.current, later=self.later)
        if mismatch is None:
            self.passed = True
            return
        self.warned = True
        if RUNTIME.elastic is None:  # an elastic job's state sync copies rank 0's at once
            warnings.warn(f"{mismatch} (No second step came to fail on: a fit of one step "
                          "ends with the ranks' models apart unless the program now gives "
                          "every rank the same weights, as a broadcast or keras_ring.elastic's "
                          "state sync does; the next step fails if it did not.)",
                          UserWarning, stacklevel=2)


class _CheckedFunction:
    """Keras's training function, checked before it trains (attributes pass through, so a
    ``tf.function``'s ``function_spec`` and ``get_concrete_function`` stay reachable)."""

    def __init__(self, function: Any, checker: _Checker) -> None:
        self._keras_ring_checked = function
        self._checker = checker

    def __call__(self, *args, **kwargs):
        self._checker.before_step()
        # This check covers the model: the optimizers' in-step check (``_step_check``, for
        # custom loops) stays out of the step while Keras traces it here.
        outer = getattr(_fit_step, "checked", False)
        _fit_step.checked = self._checker.current not in (None, _UNKNOWN)
        made = collectives_made()
        try:
            result = self._keras_ring_checked(*args, **kwargs)
        finally:
            _fit_step.checked = outer
        if self._checker.communicates is None:  # the first call: Python ran the step
            self._checker.communicates = collectives_made() > made
        self._checker.after_step()
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._keras_ring_checked, name)


def install(model: Any, settings: Settings) -> None:
    """Makes the training function of ``model`` check that every rank holds the same
    trainable weights (see above). ``settings()``, asked when it compares (the model may
    have been compiled again since), gives the ids of variables left out (local layers'
    weights differ by design) and the process set that trains, or None when the model's
    optimizer no longer communicates.
    """
    if getattr(model, _INSTALLED, None) is not None or not hasattr(model, "make_train_function"):
        return
    original = model.make_train_function
    checker = _Checker(model, settings)

    def make_train_function(force: bool = False):
        result = original(force=force)
        function = model.train_function  # Keras sets it; some versions also return it
        if function is not None and not isinstance(function, _CheckedFunction):
            checker.new_function()
            model.train_function = _CheckedFunction(function, checker)
        return model.train_function if result is not None else result

    model.make_train_function = make_train_function
    setattr(model, _INSTALLED, checker)


def communicates(model: Any) -> bool | None:
    """Whether the first step of the training function of ``model`` made a keras_ring
    collective (averaged gradients, say); None where no step ran since it was made, or the
    check is not installed."""
    checker = getattr(model, _INSTALLED, None)
    return checker.communicates if isinstance(checker, _Checker) else None


def settle(model: Any) -> None:
    """Compares again, as an epoch ends, weights of ``model`` whose verdict waits for a second
    step (where the check is installed), warning where they still differ; a collective where
    one waits, on every rank alike."""
    checker = getattr(model, _INSTALLED, None)
    if isinstance(checker, _Checker):
        checker.settle()


def new_fit(model: Any) -> None:
    """Tells the check of ``model`` (where installed) that a ``fit`` begins."""
    checker = getattr(model, _INSTALLED, None)
    if isinstance(checker, _Checker):
        checker.new_fit()


_UNSIGNED = {1: tf.uint8, 2: tf.uint16, 4: tf.uint32, 8: tf.uint32}


def fingerprint(value: Any) -> tf.Tensor:
    """The sum of the value's elements' bit patterns modulo 2**32, as an int64.

    Unsigned addition wraps exactly, so the sum is the same in any order; 4- and 8-byte
    elements are summed in place as 32-bit words (no widened copy of a large weight).
    """
    value = tf.convert_to_tensor(value)
    if not (value.dtype.is_floating or value.dtype.is_integer):
        return tf.constant(0, tf.int64)  # bool, complex, string: not trained by gradients
    words = tf.bitcast(value, _UNSIGNED[value.dtype.size])
    if words.dtype != tf.uint32:
        words = tf.cast(words, tf.uint32)
    return tf.cast(tf.reduce_sum(words), tf.int64)


def trained_variables(model: Any, local: set[int]) -> list[Any]:
    return [v for v in model.trainable_variables if not variable_keys(v) & local]


def frozen_variables(model: Any, local: set[int]) -> list[Any]:
    """The model's frozen weights (``_keras_private.frozen_weights``) but the local ones."""
    return [v for v in _keras_private.frozen_weights(model) if not variable_keys(v) & local]


# The error's text; a traced step fills in {count}, {shown} and {odd} with string tensors.
TEMPLATE = (
    f"keras_ring: {WEIGHTS_DIFFER}: {{where}}, {{count}} of {{total}} "
    "{kind} ({shown}) differ between rank {first} and rank(s) {odd}, also after "
    "the first step. Averaged gradients never remove such a difference. Start every rank "
    "from the same weights: {advice}; weights meant to differ belong to the local_layers of "
    "a {partial}. KERAS_RING_CHECK_WEIGHTS=0 (on every rank) turns this check off.")
FIT_ADVICE = (
    "put keras_ring.callbacks.BroadcastGlobalVariablesCallback(0) in fit's callbacks (or call "
    "keras_ring.broadcast_variables(model.variables, root_rank=0) before training)")


# The end of an epoch: the weights were equal as the fit began, the training moved them apart.
DRIFT_TEMPLATE = (
    f"keras_ring: {WEIGHTS_DIFFER}: {{where}}, {{count}} of {{total}} "
    "{kind} ({shown}) differ between rank {first} and rank(s) {odd}, though they were equal "
    "when the fit began: the training updated them differently on each rank. Update every "
    "weight with the ranks' averaged gradients: a keras_ring-wrapped optimizer that is "
    "model.optimizer or an attribute of the model (an optimizer a custom train_step reaches "
    "any other way is one keras_ring cannot see), or gradients from DistributedGradientTape; "
    "code that assigns weights from this rank's own data makes them differ too, as does a "
    "callback that sets them on some ranks only; weights meant to differ belong to the "
    "local_layers of a {partial}. KERAS_RING_CHECK_WEIGHTS=0 (on every rank) turns this "
    "check off.")


LAYOUT_TEMPLATE = (
    f"keras_ring: {WEIGHTS_DIFFER}: {{where}}, the ranks train different weights "
    "({detail}). Their averaged gradients would mix different weights' gradients. A layer is "
    "frozen (trainable=False) on some ranks only, or the ranks built different models: set "
    "the trainable flags alike on every rank, then compile (or trace the step) again.")


def compare_variables(variables: list[Any], text: dict[str, Any],
                      process_set: ProcessSet = global_process_set,
                      tolerance: float | None = None,
                      layout: Layout | None = None) -> WeightMismatchError | None:
    """The error to raise on every rank of ``process_set`` when their ``variables`` differ,
    else None; a collective: every rank calls it. ``text`` fills TEMPLATE's ``where``,
    ``advice`` and ``partial``. With a ``tolerance``, weights whose bits differ are compared
    by value (relative to their largest magnitude) too. ``layout`` tags which variables
    these are (by default their dtypes and shapes): where the ranks' tags differ they train
    different variables, a difference no broadcast mends (the error's ``layout`` is True)."""
    ranks = process_set.members()
    if len(ranks) < 2:
        return None
    layout = layout or Layout(variables)
    with tf.init_scope():  # eager, also when called while a function traces
        mine = row(layout, [fingerprint(value_of(v)) for v in variables])
        rows = split_rows(allgather(mine, name=NAME, process_set=process_set).numpy(),
                          len(ranks))
    for rank, (tags, prints) in zip(ranks[1:], rows[1:]):
        if tags != rows[0][0] or len(prints) != len(rows[0][1]):
            detail = (layout.describe(rows[0][0], tags, ranks[0], rank) if tags != rows[0][0]
                      else f"rank {ranks[0]} holds {len(rows[0][1])} trainable and frozen "
                           f"weights, rank {rank} {len(prints)}")
            return _error(LAYOUT_TEMPLATE.format(where=text["where"], detail=detail), rank,
                          layout=True)
    apart = np.stack([p for _, p in rows]) != rows[0][1]  # by rank and weight
    if tolerance is not None and apart.any():
        apart = _beyond(variables, apart, tolerance, ranks[0], process_set)
    differs = apart.any(axis=0)
    if not differs.any():
        return None
    odd = [ranks[i] for i in range(1, len(ranks)) if apart[i].any()]
    names = [label(v) for v, d in zip(variables, differs) if d]
    shown = ", ".join(f"'{n}'" for n in names[:SHOWN]) + (", ..." if len(names) > SHOWN else "")
    template = text.get("template", TEMPLATE)
    fields = {"kind": "trainable weights", **text}
    return _error(template.format(count=len(names), total=len(variables), shown=shown,
                                  first=ranks[0], odd=", ".join(map(str, odd)), **fields),
                  odd[0])


def _error(message: str, rank: int, layout: bool = False) -> WeightMismatchError:
    error = WeightMismatchError.about(rank, message)
    error.layout = layout
    return error


def _beyond(variables: list[Any], apart: np.ndarray, tolerance: float, root: int,
            process_set: ProcessSet) -> np.ndarray:
    """Of the (rank, weight) pairs whose bits differ, those whose values differ by more than
    ``tolerance`` of the weight's largest magnitude from the root's (every rank alike)."""
    which = [j for j in range(len(variables)) if apart[:, j].any()]
    with tf.init_scope():
        relative = []
        for j in which:
            value = tf.cast(value_of(variables[j]), tf.float64)
            roots = broadcast(value, root, name=f"{NAME}.values.{j}", process_set=process_set)
            scale = tf.maximum(tf.reduce_max(tf.abs(roots)), tf.reduce_max(tf.abs(value)))
            relative.append(tf.reduce_max(tf.abs(value - roots)) / tf.maximum(scale, 1e-30))
        everyone = allgather(tf.stack(relative)[tf.newaxis], name=f"{NAME}.relative",
                             process_set=process_set).numpy()
    beyond = np.zeros_like(apart)
    beyond[:, which] = everyone > tolerance
    return beyond


def value_of(variable: Any) -> Any:
    return variable.value if isinstance(variable, keras.Variable) else variable


def compare_weights(model: Any, local: set[int], process_set: ProcessSet = global_process_set,
                    later: bool = False, drift: str | None = None
                    ) -> WeightMismatchError | None:
    """The error to raise on every rank of ``process_set`` when their trainable or frozen
    weights (except those with ids in ``local``) differ, else None; a collective: every rank
    calls it. ``later``: they compared equal at an earlier fit and trained since; ``drift``
    (when, such as "at the end of epoch 3"): they did in this fit, which trained since."""
    where = f"at the start of training model '{model.name}'"
    if later:
        where = (f"as a later fit of model '{model.name}' begins (they were equal when it began "
                 "training: since then something changed them on some ranks only, such as a "
                 "checkpoint loaded on one rank, or EarlyStopping(restore_best_weights=True) "
                 "restoring each rank's own best epoch, which MetricAverageCallback first in "
                 "fit's callbacks makes the same)")
    text = {"where": where, "advice": FIT_ADVICE, "partial": "PartialDistributedOptimizer"}
    if drift is not None:
        text.update(where=f"{drift} of model '{model.name}'", template=DRIFT_TEMPLATE)
    trained = trained_variables(model, local)
    # Frozen weights too: a frozen base restored on one rank only computes differently on
    # each rank, though the trainable weights agree (no broadcast: nothing mends it).
    frozen = frozen_variables(model, local)
    if frozen:
        text["kind"] = "trainable and frozen weights"
    return compare_variables(trained + frozen, text, process_set,
                             tolerance=LATER_TOLERANCE if later or drift else None,
                             layout=ModelLayout(model, trained))


def _compared(model: Any) -> set[int] | None:
    """The ids the model's check leaves out, where it compared the weights equal in this
    fit since the last ``init()``; else None."""
    checker = getattr(model, _INSTALLED, None)
    if (not isinstance(checker, _Checker) or not checker.passed
            or checker.generation != RUNTIME.generation):
        return None
    current = checker.present_settings()  # asked anew for a function made mid-fit
    return None if current is None else current[0]


def digest(model: Any) -> float:
    """48 bits of the fingerprints of the weights ``compare_weights`` compares, for the rows
    of fit's epoch check; 0.0 where the check has not compared them equal in this fit."""
    local = _compared(model)
    if local is None:
        return 0.0
    variables = trained_variables(model, local) + frozen_variables(model, local)
    if not variables:
        return 0.0
    with tf.init_scope():  # one read of all the fingerprints
        prints = tf.stack([fingerprint(value_of(v)) for v in variables]).numpy()
    return float(int.from_bytes(hashlib.blake2b(prints.tobytes(), digest_size=6).digest(),
                                "little"))


def drifted(model: Any, when: str, process_set: ProcessSet) -> WeightMismatchError | None:
    """The error for weights that this fit moved apart by ``when`` ("at the end of epoch 3";
    every rank calls this alike, where the ranks' digests differed: a collective), or None
    where they differ only by rounding (a GPU's updates need not be bit-identical)."""
    local = _compared(model)
    return compare_weights(model, set() if local is None else local, process_set, drift=when)
