"""``fit`` checks that the ranks begin each epoch together, and with the same learning rates.

A callback that sets the rate from this rank's own epoch metrics decides on each rank alone
(``ReduceLROnPlateau`` without ``MetricAverageCallback`` before it). Ranks that then apply the
same averaged gradients with different rates train apart (the weights' digest below would
tell an epoch later, naming weights, not the rate). The rates are compared after every
callback's ``on_epoch_begin``
(``LearningRateScheduler`` sets the rate there) and before the epoch's first step: one
allgather of a float64 per optimizer per epoch. A rank that stopped instead
(``EarlyStopping``) has left ``fit``: its peers' check fails on its shutdown notice, as their
next step would. A fit's first epoch compares the rates at its first batch, after the
broadcast callback has given every rank the root's rate: a rate set on some ranks only
between fits (keras-io's fine-tuning) would else go unseen by a one-epoch fit.
The same allgather carries the epoch: ranks that resume at different epochs (a backup
restored on rank 0 alone) would run different numbers of steps; and, from the first epoch, a
digest of each optimizer's other settings (``_optimizer_settings``), and at the first epoch
one of the model's adapted preprocessing state (``_adapted_state``), one of how its layers
are built (``_model_config``) and whether fit's callbacks write files (``_shared_files``);
a digest of the weights taken as the last epoch ended (``_weight_check.digest``): equal as
the fit began, the training must keep them equal. The rates and that digest are compared
once more as ``fit`` ends: a change in the last (or only) epoch met no epoch's check.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from keras_ring import (_adapted_state, _keras_private, _model_config, _optimizer_settings,
                        _shared_files, _weight_check)
from keras_ring.collectives import allgather
from keras_ring.errors import (RATE_CHECK, TRAIN_END, EpochMismatchError,
                               LearningRateMismatchError)
from keras_ring.process_sets import ProcessSet
from keras_ring.runtime import RUNTIME

NAME = "keras_ring.rate_check"

Finder = Callable[[Any], "tuple[list[Any], ProcessSet] | None"]


def current_rate(optimizer: Any) -> float:
    """The rate the optimizer's next update uses (a schedule's value at its step)."""
    return float(np.asarray(keras.ops.convert_to_numpy(optimizer.learning_rate)))


def rated(optimizers: list[Any]) -> list[Any]:
    """The optimizers whose rates and settings are compared: a ``MultiOptimizer`` has no rate
    of its own (reading it raises), its sub-optimizers do, each its own, so they stand in its
    place. Asked at each comparison: a MultiOptimizer given a function finds its
    sub-optimizers as it is built, alike on every rank."""
    found = []
    for optimizer in optimizers:
        parts = _keras_private.sub_optimizers(optimizer)
        found.extend([optimizer] if parts is None else parts)
    return found


class RateCheck(keras.callbacks.Callback):
    """Compares the epoch, the optimizers' settings and their learning rates over
    ``process_set`` as each epoch of a ``fit`` begins (the first epoch's rates at its first
    batch, after the broadcast callback), and the rates again as fit ends."""

    def __init__(self, optimizers: list[Any], process_set: ProcessSet | None,
                 find: Finder | None = None) -> None:
        super().__init__()
        self.optimizers = optimizers
        self.process_set = process_set
        self._find = find
        self._first = True
        self._rates_pending = False
        self._weights = 0.0  # the digest of the weights as the last epoch ended
        self._ended = -1  # that epoch
        self.written: list = []  # what fit's other callbacks write (_shared_files)

    @classmethod
    def later(cls, find: Finder) -> "RateCheck":
        """One that asks ``find`` as training begins: a MultiOptimizer given a function knows
        its (maybe wrapped) sub-optimizers only once built, after fit has begun."""
        return cls([], None, find)

    def on_train_begin(self, logs: dict | None = None) -> None:
        if self._find is not None:
            self.optimizers, self.process_set = self._find(self.model) or ([], None)
        if self.process_set is None:
            return
        self._first, self._rates_pending = True, False
        self._weights, self._ended = 0.0, -1
        # Variables assigned since the layers last read them (a broadcast_variables before
        # fit) reach the Normalization layers' copies before the step is traced.
        _adapted_state.refresh(self.model)
        _weight_check.new_fit(self.model)  # weights changed between fits, on some ranks only

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        if self.process_set is None:  # found no keras_ring optimizer after all
            return
        ranks = self.process_set.members()
        first, self._first = self._first, False
        if len(ranks) < 2 or not RUNTIME.config.check_weights:
            return
        optimizers = rated(self.optimizers)
        count = len(optimizers)
        # Weights: equal as the fit began (the weight check), so the digest taken at the
        # last epoch's end (0.0 before) must be the same on every rank.
        mine = np.array([epoch] + [current_rate(o) for o in optimizers] +
                        [_optimizer_settings.digest(_optimizer_settings.settings(o))
                         for o in optimizers] + [0.0 if first else self._weights] +
                        (self._first_epoch_digests() if first else [0.0] * 3), np.float64)
        everyone = allgather(tf.constant(mine[np.newaxis]), name=NAME,
                             process_set=self.process_set).numpy()
        if (everyone[:, 0] != epoch).any():
            raise _epoch_mismatch(ranks, everyone[:, 0])
        if (everyone[:, 1 + count:-4] != everyone[0, 1 + count:-4]).any():
            raise _optimizer_settings.mismatch(optimizers, ranks, epoch, self.process_set)
        self._compare_weights(everyone[:, -4], f"at the end of epoch {self._ended}")
        self._compare_first_epoch_digests(everyone[:, -3:], ranks)
        if first:  # the rates: the broadcast callback may still set them, at the first batch
            self._rates_pending = True
            return
        _compare_rates(ranks, everyone[:, 1:1 + count], f"as epoch {epoch} begins", _EPOCH_CAUSE)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        # Taken here, sent as the next epoch begins or fit ends: after every callback's
        # on_epoch_end (this one is fit's last), before EarlyStopping(restore_best_weights)
        # restores each rank's own best epoch in its on_train_end, which the next fit's
        # weight check names (failing this fit would lose what it trained).
        if (self.process_set is not None and RUNTIME.config.check_weights
                and len(self.process_set.members()) > 1):
            # A fit of one step would else end silently with weights that differed before
            # its first step (a warning: the program may still mend them).
            _weight_check.settle(self.model)
            self._weights, self._ended = _weight_check.digest(self.model), epoch

    def _compare_weights(self, digests: np.ndarray, when: str) -> None:
        """Every rank raises alike where the weights' digests differ beyond rounding."""
        if (digests != digests[0]).any():
            drifted = _weight_check.drifted(self.model, when, self.process_set)
            if drifted is not None:
                raise drifted

    def _first_epoch_digests(self) -> list[float]:
        return [_adapted_state.digest(self.model), _model_config.digest(self.model),
                1.0 if self.written else 0.0]

    def _compare_first_epoch_digests(self, digests: np.ndarray, ranks: list[int]) -> None:
        """Every rank raises alike where the first epoch's digests say the ranks preprocess
        or build their models differently, or write the same files."""
        if (digests[:, 0] != digests[0, 0]).any():
            raise _adapted_state.mismatch(self.model, ranks, self.process_set)
        if (digests[:, 1] != digests[0, 1]).any():
            built_apart = _model_config.mismatch(self.model, ranks, self.process_set)
            if built_apart is not None:  # else the weight check names how the weights differ
                raise built_apart
        if digests[:, 2].any():  # some rank's callbacks write files: which, and whose
            shared = _shared_files.collision(self.written, ranks, self.process_set)
            if shared is not None:
                raise shared

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        # A fit's first epoch: after every callback's broadcast. Rates set on some ranks only
        # between fits (a fine-tuning rate) would else go unseen by a one-epoch fit.
        if not self._rates_pending:
            return
        self._rates_pending = False
        mine = np.array([current_rate(o) for o in rated(self.optimizers)], np.float64)
        everyone = allgather(tf.constant(mine[np.newaxis]), name=f"{NAME}.first_batch",
                             process_set=self.process_set).numpy()
        ranks = self.process_set.members()
        _compare_rates(ranks, everyone, "as training begins", _START_CAUSE)

    def on_train_end(self, logs: dict | None = None) -> None:
        if self.process_set is None:  # found no keras_ring optimizer after all
            return
        # A rate changed on some ranks during the last epoch (or the only one) meets no
        # epoch's check: fit would return weights that differ by rank, and exit 0.
        ranks = self.process_set.members()
        if len(ranks) < 2 or not RUNTIME.config.check_weights:
            return
        mine = np.array([current_rate(o) for o in rated(self.optimizers)] + [self._weights],
                        np.float64)
        everyone = allgather(tf.constant(mine[np.newaxis]), name=TRAIN_END,
                             process_set=self.process_set).numpy()
        _compare_rates(ranks, everyone[:, :-1], "as fit ends", _END_CAUSE)
        self._compare_weights(everyone[:, -1], f"at the end of epoch {self._ended}")


_EPOCH_CAUSE = (
    "A callback set the rate from this rank's own metrics (ReduceLROnPlateau reads this "
    "rank's loss): put keras_ring.callbacks.MetricAverageCallback() first in fit's callbacks, "
    "so every later callback sees the same averaged metrics and decides alike.")
_END_CAUSE = (
    "The rate changed on some ranks only during the last epoch: a callback set it from this "
    "rank's own metrics (put keras_ring.callbacks.MetricAverageCallback() first in fit's "
    "callbacks), code that runs on some ranks only set it, or the ranks' learning-rate "
    "schedules differ. The ranks' weights differ now.")
_START_CAUSE = (
    "The rate was set on some ranks only (before this fit, or when the optimizer was made): "
    "set it alike on every rank, or put keras_ring.callbacks.BroadcastGlobalVariablesCallback"
    "(0) in fit's callbacks, which gives every rank the root's optimizer state.")


def _compare_rates(ranks: list[int], rates: np.ndarray, when: str, cause: str) -> None:
    """Raises on every rank where the ranks' ``rates`` (a row per rank) differ in any bit."""
    bits = np.ascontiguousarray(rates).view(np.int64)
    if (bits == bits[0]).all():
        return
    odd = [i for i in range(1, len(ranks)) if (bits[i] != bits[0]).any()]
    shown = ", ".join(f"rank {ranks[i]} {_rates(rates[i])}" for i in [0] + odd)
    error = LearningRateMismatchError.about(
        ranks[odd[0]],
        f"keras_ring: the ranks train with different learning rates {when} ({shown}): they "
        f"would apply the same averaged gradients differently and train apart. {cause} "
        "KERAS_RING_CHECK_WEIGHTS=0 (on every rank) turns this check off.")
    raise error


def _epoch_mismatch(ranks: list[int], epochs: np.ndarray) -> EpochMismatchError:
    odd = [i for i in range(1, len(ranks)) if epochs[i] != epochs[0]]
    shown = ", ".join(f"rank {ranks[i]} at epoch {int(epochs[i])}" for i in [0] + odd)
    error = EpochMismatchError.about(
        ranks[odd[0]],
        f"keras_ring: the ranks begin an epoch of fit at different epochs ({shown}): they "
        "would run different numbers of steps. A checkpoint was restored on some ranks only "
        "(keras.callbacks.BackupAndRestore under on_rank_zero: give each rank its own "
        "backup_dir, e.g. f'backup/{keras_ring.rank()}', so every rank resumes); the "
        "ranks' own backups hold different epochs (a rank stopped between the ranks' "
        "epoch-end saves, and each BackupAndRestore keeps only its latest: remove every "
        "rank's backup_dir to start over, or resume every rank from one checkpoint, e.g. "
        "rank 0's ModelCheckpoint loaded everywhere with initial_epoch); initial_epoch "
        "differs between ranks; or an earlier fit ended early on some ranks only (a "
        "callback that set model.stop_training from this rank's own metrics: put "
        "keras_ring.callbacks.MetricAverageCallback() before it).")
    return error


def _rates(values: np.ndarray) -> str:
    return "/".join(f"{v:.6g}" for v in values)


class BatchRates:
    """``train_on_batch``'s rate check: a loop of the program's own sets the rate between
    calls (a plateau rule on this rank's loss, code under ``if rank == 0``), where no epoch
    begins. The rates are compared at the first call after ``init()`` and at each call that
    finds this rank's changed since the last comparison. Reading a rate costs a TensorFlow
    op (100-400 us on a loaded 2-core machine, ~10% of a small model's call), so it is read
    only where its variable was assigned since (:func:`_assignments`); the allgather runs
    only where the value changed. A rank that changed its rate alone meets its peers'
    training step with that allgather: the mismatch names it (``errors.py`` adds the
    cause). Rates that a schedule computes from the step count are equal where the steps
    are, and left out (they change on every call)."""

    def __init__(self) -> None:
        self.generation: int | None = None
        self.rates: bytes | None = None
        self.assigned: tuple | None = None  # _assignments() when the rates were last read
        # What ``find`` said, and for which optimizer and training function: compile makes
        # new ones (walking the model's attributes on every call cost ~150 us).
        self.found: tuple[Any, Any] = (None, None)
        self.found_for: tuple[int, int] | None = None

    @staticmethod
    def of(model: Any) -> "BatchRates":
        """The model's own, kept in its ``__dict__`` (where Keras tracks nothing)."""
        return model.__dict__.setdefault(_BATCH_STATE, BatchRates())

    def check(self, optimizers: list[Any], process_set: ProcessSet) -> None:
        RUNTIME.topology("training with a keras_ring optimizer")  # init() came first
        ranks = process_set.members()
        if len(ranks) < 2 or not RUNTIME.config.check_weights:
            return
        optimizers = rated(optimizers)
        assigned = tuple(_assignments(o) for o in optimizers)
        same_world = self.generation == RUNTIME.generation
        if same_world and self.assigned == assigned:
            return
        self.assigned = assigned
        mine = np.array([0.0 if _scheduled(o) else current_rate(o) for o in optimizers],
                        np.float64)
        if same_world and self.rates == mine.tobytes():
            return
        everyone = allgather(tf.constant(mine[np.newaxis]), name=RATE_CHECK,
                             process_set=process_set).numpy()
        _compare_rates(ranks, everyone, "at a train_on_batch call", _BATCH_CAUSE)
        self.generation, self.rates = RUNTIME.generation, mine.tobytes()


_BATCH_STATE = "_keras_ring_batch_rates"
_BATCH_CAUSE = (
    "The program set the rate on some ranks only (from this rank's own loss, or in code "
    "that runs on some ranks only): set it alike on every rank, from values every rank "
    "shares (keras_ring.allreduce of the loss).")


_ASSIGNED = "_keras_ring_assignments"


def _assignments(optimizer: Any) -> tuple[int, int] | None:
    """(identity, how many times it was assigned since watched) of the optimizer's rate
    variable; None where a schedule gives the rate. Its ``assign`` methods are wrapped on
    the instance, once: setting ``optimizer.learning_rate`` and assigning the variable
    (also by a broadcast, a checkpoint load or an elastic restore) all go through them."""
    variable = getattr(optimizer, "_learning_rate", None)
    # Not isinstance(keras.Variable): Keras 3.5's variables are not instances of it.
    if callable(variable) or not hasattr(variable, "assign"):
        return None
    counts = vars(variable)
    if _ASSIGNED not in counts:
        counts[_ASSIGNED] = 0
        for name in ("assign", "assign_add", "assign_sub"):
            setattr(variable, name, _counted(counts, getattr(variable, name)))
    return id(variable), counts[_ASSIGNED]


def _counted(counts: dict, assign: Callable) -> Callable:
    @functools.wraps(assign)
    def counted(*args, **kwargs):
        counts[_ASSIGNED] += 1
        return assign(*args, **kwargs)
    return counted


def _scheduled(optimizer: Any) -> bool:
    """Whether a schedule (or a callable) gives the optimizer's rate from its step count."""
    return callable(getattr(optimizer, "_learning_rate", None))


def install_fit_hook(find: Finder) -> None:
    """Makes ``Model.fit`` add a :class:`RateCheck` for a model that ``find`` says trains
    with keras_ring optimizers (a list of callbacks is extended, never changed in place),
    and ``Model.train_on_batch`` compare the rates as :class:`BatchRates` says."""
    _install_train_on_batch_hook(find)
    owner = next(klass for klass in keras.Model.__mro__ if "fit" in vars(klass))
    original = owner.fit
    if getattr(original, "_keras_ring", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def fit(self, *args, **kwargs):
        found, check = find(self), None
        if found is not None:
            RUNTIME.topology("Model.fit() with a keras_ring optimizer")  # init() came first
            check = RateCheck(*found)
        elif _keras_private.sub_optimizers(getattr(self, "optimizer", None)) is not None:
            check = RateCheck.later(find)  # a MultiOptimizer not built yet
        if check is not None:
            bound = signature.bind(self, *args, **kwargs)
            callbacks = bound.arguments.get("callbacks")
            check.written = _shared_files.written_files(
                callbacks.callbacks if isinstance(callbacks, keras.callbacks.CallbackList)
                else callbacks)
            if callbacks is None or isinstance(callbacks, (list, tuple)):
                bound.arguments["callbacks"] = [*(callbacks or []), check]
                return original(*bound.args, **bound.kwargs)
            if isinstance(callbacks, keras.callbacks.CallbackList):  # fit takes it as is
                bound.arguments["callbacks"] = keras.callbacks.CallbackList(
                    [*callbacks.callbacks, check], model=self,
                    **(getattr(callbacks, "params", None) or {}))  # Keras < 3.x: unset
                return original(*bound.args, **bound.kwargs)
        return original(self, *args, **kwargs)

    fit._keras_ring = True
    owner.fit = fit


def _install_train_on_batch_hook(find: Finder) -> None:
    owner = next(klass for klass in keras.Model.__mro__ if "train_on_batch" in vars(klass))
    original = owner.train_on_batch
    if getattr(original, "_keras_ring", False):
        return

    @functools.wraps(original)
    def train_on_batch(self, *args, **kwargs):
        rates = BatchRates.of(self)
        key = (id(getattr(self, "optimizer", None)), id(getattr(self, "train_function", None)))
        if rates.found_for != key:
            rates.found, rates.found_for = find(self), key
        if rates.found is not None:
            rates.check(*rates.found)
        return original(self, *args, **kwargs)

    train_on_batch._keras_ring = True
    owner.train_on_batch = train_on_batch
