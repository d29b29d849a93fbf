"""``LearningRateWarmupCallback``: gradual warmup to the large-batch learning rate."""

from __future__ import annotations

from typing import Any

import keras

from keras_ring.basics import rank, size
from keras_ring.callbacks import _learning_rate as lr_util


def _positive_number(value: Any, what: str, allow_zero: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (
        value >= 0 if allow_zero else value > 0
    )
    if not ok:
        bound = "a non-negative" if allow_zero else "a positive"
        raise ValueError(f"{what} must be {bound} number, got {value!r}")
    return float(value)


class LearningRateWarmupCallback(keras.callbacks.Callback):
    """Raises the learning rate from ``initial_lr / size()`` to ``initial_lr`` over the first epochs.

    With N ranks the global batch is N times larger and the rate is usually scaled by N;
    starting at that rate can diverge. Following Goyal et al. (2017), "Accurate, Large
    Minibatch SGD", the rate grows linearly, batch by batch::

        lr = initial_lr / size * (e * (size - 1) / warmup_epochs + 1)

    where ``e = epoch + (batch + 1) / steps_per_epoch`` is the fractional epoch counted after
    the batch. The first batch runs at about ``initial_lr / size``, the last warmup batch at
    exactly ``initial_lr``, and from then on the callback no longer touches the rate (so a
    ``LearningRateScheduleCallback`` with ``start_epoch=warmup_epochs`` can take over).

    The rate is set before each batch (with ``steps_per_execution=k``, before each group of
    k batches, at the rate of the group's last batch, so the warmup still ends at exactly
    ``initial_lr``). The optimizer's learning rate must be a float (a variable), not a
    ``LearningRateSchedule``; a schedule raises a ``ValueError`` at the start of training.

    Args:
        initial_lr: the rate at the end of warmup; by default the optimizer's rate when
            training starts (the already-scaled rate, e.g. ``0.1 * size()``), the root
            rank's (a checkpoint restored there is broadcast only in the first batch). A
            warmup resumed mid-way needs it given: the restored rate is not the target.
        warmup_epochs: how many epochs the warmup lasts (may be fractional). Default 5.
        momentum_correction: rescale SGD's and RMSprop's momentum velocity by new / old
            rate whenever the rate changes, as the paper prescribes. Default True.
        steps_per_epoch: batches per epoch; by default what ``fit()`` reports.
        verbose: if > 0, rank 0 prints a line when the warmup ends.

    Example:

    ```python
    optimizer = keras_ring.wrap(keras.optimizers.SGD(0.01 * keras_ring.size(), momentum=0.9))
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, epochs=10, callbacks=[
        keras_ring.callbacks.BroadcastGlobalVariablesCallback(0),
        keras_ring.callbacks.LearningRateWarmupCallback(warmup_epochs=3)])
    ```
    """

    def __init__(self, initial_lr: float | None = None, warmup_epochs: float = 5,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None,
                 verbose: int = 0) -> None:
        super().__init__()
        self.initial_lr = None if initial_lr is None else _positive_number(initial_lr, "initial_lr")
        self.warmup_epochs = _positive_number(warmup_epochs, "warmup_epochs", allow_zero=True)
        self.momentum_correction = bool(momentum_correction)
        if steps_per_epoch is not None:
            _positive_number(steps_per_epoch, "steps_per_epoch")
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self._epoch = 0
        self._steps = 1
        self._per_call = 1  # batches one on_train_batch_begin covers (steps_per_execution)
        self._finished = False
        self._announce = False  # the warmup ended in this epoch: say so at its end

    def on_train_begin(self, logs: dict | None = None) -> None:
        optimizer = lr_util.optimizer_of(self.model, "LearningRateWarmupCallback")
        lr_util.check_settable(optimizer, "LearningRateWarmupCallback")
        if self.initial_lr is None:
            self.initial_lr = lr_util.root_rate(self.model, optimizer, "LearningRateWarmupCallback")
        self._steps = lr_util.steps_per_epoch(self.steps_per_epoch, self.params,
                                              "LearningRateWarmupCallback")
        self._per_call = max(1, int(getattr(self.model, "steps_per_execution", 1) or 1))

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._say_finished()
        self._epoch = epoch

    def learning_rate_at(self, epoch: int, batch: int, batches: int = 1) -> float | None:
        """The rate batch ``batch`` of epoch ``epoch`` runs at, with the ``batches - 1`` after
        it (one call of a ``steps_per_execution`` model's step runs them all at one rate: the
        rate of the last), or None once warmup is over."""
        if epoch + batch / self._steps >= self.warmup_epochs:
            return None
        e = epoch + min(batch + batches, self._steps) / self._steps
        if e >= self.warmup_epochs:
            return self.initial_lr  # exactly, not a rounding away from it
        n = size()
        return self.initial_lr / n * (e * (n - 1) / self.warmup_epochs + 1)

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        rate = self.learning_rate_at(self._epoch, batch, self._per_call)
        if rate is None:
            return
        lr_util.set_rate(self.model.optimizer, rate, self.momentum_correction)
        if rate == self.initial_lr and not self._finished:
            self._finished = True
            self._announce = True  # at the end of the epoch, as Keras's own callbacks do

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        lr_util.log_rate(self.model, logs)

    def on_train_end(self, logs: dict | None = None) -> None:
        self._say_finished()

    def _say_finished(self) -> None:
        # Once the epoch's progress bar is complete (Keras's ProgbarLogger runs after user
        # callbacks, so: at the next epoch's start, or at the end of training), as
        # EarlyStopping reports after the bar, not into its carriage-return updates.
        if self._announce and self.verbose and rank() == 0:
            print(f"Epoch {self._epoch + 1}: finished gradual learning rate warmup to "
                  f"{self.initial_lr:g}.", flush=True)
        self._announce = False
