"""``LearningRateScheduleCallback``: a learning rate that follows a per-epoch multiplier."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import keras

from keras_ring.callbacks import _learning_rate as lr_util


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets ``lr = initial_lr * multiplier(epoch)`` for epochs in ``[start_epoch, end_epoch)``.

    ``multiplier`` is a float (a decay per epoch: ``multiplier ** (epoch - start_epoch)``)
    or a function of the epoch. With ``staircase=True`` the rate is set at the start of
    each epoch from the integer epoch; with ``staircase=False`` it is set before every
    batch from the fractional epoch ``epoch + batch / steps_per_epoch``, so it changes
    smoothly and the first batch of an epoch gets the same rate as with a staircase.
    Outside the epoch range the callback does not touch the rate, so several of them can
    split the epochs between them, and one can follow a ``LearningRateWarmupCallback``.

    Every rank computes the same rate, so the ranks stay in step. The optimizer's learning
    rate must be a float (a variable), not a ``LearningRateSchedule``.

    A model that keeps its optimizers as attributes (keras-io's GAN, compiled with none)
    trains with those, not with ``model.optimizer``: the multiplier scales each one's own
    initial rate, and each epoch's logs get ``{name}_learning_rate`` for each
    (``learning_rate`` where one optimizer trains the model).

    Args:
        initial_lr: the rate the multiplier scales; None means the optimizer's rate when
            training starts, the root rank's (a checkpoint restored there is broadcast only
            in the first batch). For a model that keeps its optimizers as attributes
            (keras-io's GAN): ``None`` takes each one's own rate, a number is every one's
            (a ``ValueError`` where their rates differ), and a dict gives one per optimizer
            by attribute name (``{"d_optimizer": 2e-4, "g_optimizer": 1e-4}``). Once
            training starts it holds the rate (or the dict of rates) it scales.
        multiplier: a float, or a callable taking the (possibly fractional) epoch.
        start_epoch: the schedule applies to epochs from this one (inclusive). Default 0.
            A float is compared as Horovod does (``epoch >= start_epoch``): 5.0 is epoch 5,
            2.5 starts at epoch 3.
        end_epoch: it no longer applies from this epoch on (``epoch >= end_epoch``); None
            for no end.
        staircase: set the rate per epoch (True) or per batch (False).
        momentum_correction: rescale SGD's and RMSprop's momentum velocity by new / old
            rate on every change (Goyal et al. 2017). Default True.
        steps_per_epoch: batches per epoch (used when ``staircase=False``); by default what
            ``fit()`` reports.

    Example:

    ```python
    callbacks = [
        keras_ring.callbacks.LearningRateWarmupCallback(warmup_epochs=5),
        # Divide by 10 at epochs 30, 60 and 80, as in the ResNet-50 recipe. The factors are
        # functions: a float would be a decay per epoch (0.1 ** (epoch - start_epoch)).
        keras_ring.callbacks.LearningRateScheduleCallback(lr, 1.0, start_epoch=5, end_epoch=30),
        keras_ring.callbacks.LearningRateScheduleCallback(
            lr, lambda epoch: 1e-1, start_epoch=30, end_epoch=60),
        keras_ring.callbacks.LearningRateScheduleCallback(
            lr, lambda epoch: 1e-2, start_epoch=60, end_epoch=80),
        keras_ring.callbacks.LearningRateScheduleCallback(lr, lambda epoch: 1e-3, start_epoch=80),
    ]
    ```
    """

    def __init__(self, initial_lr: float | dict[str, float] | None,
                 multiplier: float | Callable[[float], float],
                 start_epoch: float = 0, end_epoch: float | None = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None) -> None:
        super().__init__()
        self.initial_lr = lr_util.check_initial_lr(initial_lr, _non_negative)
        self.multiplier = _as_function(multiplier, start_epoch)
        _check_epochs(start_epoch, end_epoch)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = bool(staircase)
        self.momentum_correction = bool(momentum_correction)
        self.steps_per_epoch = steps_per_epoch
        self._epoch = 0
        self._steps = 1
        self._optimizers: lr_util.Named = []  # (name, optimizer), set as training starts
        self._initial: list[float] = []  # each one's rate that the multiplier scales

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._optimizers, self._initial, self.initial_lr = lr_util.start(
            self.model, self.initial_lr, "LearningRateScheduleCallback")
        if not self.staircase:
            self._steps = lr_util.steps_per_epoch(self.steps_per_epoch, self.params,
                                                  "LearningRateScheduleCallback")

    def _active(self, epoch: int) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def learning_rate_at(self, epoch: int, batch: int = 0,
                         initial_lr: float | None = None) -> float | None:
        """The rate for batch ``batch`` of epoch ``epoch``, or None outside the epoch range.
        ``initial_lr``: the rate the multiplier scales, by default the callback's (a number)."""
        if not self._active(epoch):
            return None
        e = epoch if self.staircase else epoch + batch / self._steps
        initial = lr_util.one_rate(self.initial_lr, initial_lr, "LearningRateScheduleCallback")
        return initial * float(self.multiplier(e))

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch
        if self.staircase:
            self._set(epoch, 0)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        lr_util.log_rates(self._optimizers, logs)

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if not self.staircase:
            self._set(self._epoch, batch)

    def _set(self, epoch: int, batch: int) -> None:
        if not self._active(epoch):
            return
        for (_, optimizer), initial in zip(self._optimizers, self._initial):
            rate = self.learning_rate_at(epoch, batch, initial)
            lr_util.set_rate(optimizer, rate, self.momentum_correction)


def _non_negative(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"initial_lr must be a non-negative number or None, got {value!r}")
    return float(value)


def _as_function(multiplier: Any, start_epoch: float) -> Callable[[float], float]:
    if callable(multiplier):
        return multiplier
    if isinstance(multiplier, bool) or not isinstance(multiplier, (int, float)):
        raise TypeError(f"multiplier must be a number or a function of the epoch, got {multiplier!r}")
    factor = float(multiplier)
    return lambda epoch: factor ** (epoch - start_epoch)


def _is_number(value: Any) -> bool:
    # Horovod's examples pass argparse floats (--warmup-epochs 5.0).
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_epochs(start_epoch: Any, end_epoch: Any) -> None:
    if not _is_number(start_epoch) or start_epoch < 0:
        raise ValueError(f"start_epoch must be a non-negative number, got {start_epoch!r}")
    if end_epoch is not None and (not _is_number(end_epoch) or end_epoch <= start_epoch):
        raise ValueError(f"end_epoch must be None or a number greater than start_epoch="
                         f"{start_epoch}, got {end_epoch!r}")
