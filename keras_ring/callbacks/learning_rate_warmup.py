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

    A model that keeps its optimizers as attributes (keras-io's GAN, compiled with none)
    trains with those, not with ``model.optimizer``: each of them is warmed up from its own
    initial rate ``/ size()`` to that rate, and each epoch's logs get
    ``{name}_learning_rate`` for each (``learning_rate`` where one optimizer trains the
    model).

    The rate is set before each batch (with ``steps_per_execution=k``, before each group of
    k batches, at the rate of the group's last batch, so the warmup still ends at exactly
    ``initial_lr``). The optimizer's learning rate must be a float (a variable), not a
    ``LearningRateSchedule``; a schedule raises a ``ValueError`` at the start of training.

    Args:
        initial_lr: the rate at the end of warmup; by default the optimizer's rate when
            training starts (the already-scaled rate, e.g. ``0.1 * size()``), the root
            rank's (a checkpoint restored there is broadcast only in the first batch). A
            warmup resumed mid-way needs it given: the restored rate is not the target.
            For a model that keeps its optimizers as attributes (keras-io's GAN), each is
            warmed up to its own rate: ``None`` takes each one's, a number is every one's
            (a ``ValueError`` where their rates differ), and a dict gives one per
            optimizer by attribute name (``{"d_optimizer": 2e-4, "g_optimizer": 1e-4}``).
            Once training starts it holds the rate (or the dict of rates) warmed up to.
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

    def __init__(self, initial_lr: float | dict[str, float] | None = None,
                 warmup_epochs: float = 5,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None,
                 verbose: int = 0) -> None:
        super().__init__()
        self.initial_lr = lr_util.check_initial_lr(
            initial_lr, lambda rate: _positive_number(rate, "initial_lr"))
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
        self._optimizers: lr_util.Named = []  # (name, optimizer), set as training starts
        self._initial: list[float] = []  # each one's rate at the end of warmup

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._optimizers, self._initial, self.initial_lr = lr_util.start(
            self.model, self.initial_lr, "LearningRateWarmupCallback")
        self._steps = lr_util.steps_per_epoch(self.steps_per_epoch, self.params,
                                              "LearningRateWarmupCallback")
        self._per_call = max(1, int(getattr(self.model, "steps_per_execution", 1) or 1))

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._say_finished()
        self._epoch = epoch

    def learning_rate_at(self, epoch: int, batch: int, batches: int = 1,
                         initial_lr: float | None = None) -> float | None:
        """The rate batch ``batch`` of epoch ``epoch`` runs at, with the ``batches - 1`` after
        it (one call of a ``steps_per_execution`` model's step runs them all at one rate: the
        rate of the last), or None once warmup is over. ``initial_lr``: the rate warmed up
        to, by default the callback's (a number)."""
        initial = lr_util.one_rate(self.initial_lr, initial_lr, "LearningRateWarmupCallback")
        if epoch + batch / self._steps >= self.warmup_epochs:
            return None
        e = epoch + min(batch + batches, self._steps) / self._steps
        if e >= self.warmup_epochs:
            return initial  # exactly, not a rounding away from it
        n = size()
        return initial / n * (e * (n - 1) / self.warmup_epochs + 1)

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        reached = True
        for (_, optimizer), initial in zip(self._optimizers, self._initial):
            rate = self.learning_rate_at(self._epoch, batch, self._per_call, initial)
            if rate is None:
                return  # the same batch for every optimizer: warmup is over
            lr_util.set_rate(optimizer, rate, self.momentum_correction)
            reached = reached and rate == initial
        if reached and not self._finished:
            self._finished = True
            self._announce = True  # at the end of the epoch, as Keras's own callbacks do

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        lr_util.log_rates(self._optimizers, logs)

    def on_train_end(self, logs: dict | None = None) -> None:
        self._say_finished()

    def _say_finished(self) -> None:
        # Once the epoch's progress bar is complete (Keras's ProgbarLogger runs after user
        # callbacks, so: at the next epoch's start, or at the end of training), as
        # EarlyStopping reports after the bar, not into its carriage-return updates.
        if self._announce and self.verbose and rank() == 0:
            names = [name for name, _ in self._optimizers]
            target = (f"{self._initial[0]:g}" if len(names) == 1
                      else lr_util.describe(names, self._initial))
            print(f"Epoch {self._epoch + 1}: finished gradual learning rate warmup to "
                  f"{target}.", flush=True)
        self._announce = False
