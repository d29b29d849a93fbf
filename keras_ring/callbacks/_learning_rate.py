"""Shared by the learning-rate callbacks: reading and setting the rate, momentum correction."""

from __future__ import annotations

from typing import Any

import keras

from keras_ring import _keras_private
from keras_ring._model_optimizers import distributed_optimizers
from keras_ring.objects import broadcast_object
from keras_ring.runtime import RUNTIME


def optimizer_of(model: Any, who: str) -> keras.optimizers.Optimizer:
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        raise ValueError(f"{who} needs a compiled model with an optimizer; "
                         f"{type(model).__name__}.optimizer is None")
    return optimizer


def _innermost(optimizer: Any) -> Any:
    # A LossScaleOptimizer delegates its learning rate to the optimizer inside it.
    while isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return optimizer


def check_settable(optimizer: Any, who: str) -> None:
    """Raises unless the optimizer's learning rate is a variable that can be assigned."""
    inner = _innermost(optimizer)
    parts = _keras_private.sub_optimizers(inner)
    if parts is not None:
        known = f" ({', '.join(type(o).__name__ for o in parts)})" if parts else ""
        raise ValueError(
            f"{who} sets one learning rate, but the model trains with a MultiOptimizer, whose "
            f"sub-optimizers{known} each have their own, and Keras sets none on the "
            "MultiOptimizer itself. Give each "
            "sub-optimizer its own schedule instead (learning_rate=keras.optimizers.schedules"
            ".LearningRateSchedule, e.g. CosineDecay with warmup_steps)")
    # Keras keeps the rate as a variable or a schedule; it has no public way to ask which.
    rate = getattr(inner, "_learning_rate", None)
    if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule) or (
        callable(rate) and not isinstance(rate, _keras_private.variable_classes())
    ):
        raise ValueError(
            f"{who} sets the learning rate each batch, but this {type(inner).__name__} was "
            f"created with learning_rate={type(rate).__name__}(...), which cannot be set. "
            "Either keep the optimizer's schedule and drop the callback, or create the "
            "optimizer with a float learning_rate and express the schedule with keras_ring's "
            "callbacks (LearningRateWarmupCallback, LearningRateScheduleCallback)."
        )


def current_rate(optimizer: Any) -> float:
    rate = optimizer.learning_rate
    # .numpy() rather than np.asarray: the latter trips NumPy 2's copy= deprecation warning.
    return float(rate.numpy() if hasattr(rate, "numpy") else rate)


def root_rate(model: Any, optimizer: Any, who: str) -> float:
    """The rate a callback given no ``initial_lr`` starts from: the root's (the first rank
    the model's keras_ring optimizers average over). A checkpoint restored on the root only
    reaches the others with the broadcast, in the first batch, after ``on_train_begin``:
    each rank's own rate would make each warm up to its own, silently.

    Raises:
        ValueError: in an elastic job, where every world after the first resumes with the
            committed, already warmed or decayed rate (a callback made anew in ``train``
            aimed at that, silently), and only a newcomer's callback made before ``train``
            would ask the root (a mismatch that ended the job).
    """
    if RUNTIME.elastic is not None:
        raise ValueError(
            f"{who}: pass initial_lr in an elastic job (as Horovod requires): every world "
            "after the first resumes from the last commit, where the optimizer's rate is "
            "the warmed or scheduled one, not the initial rate, and a worker that joins "
            "would read it where the others do not")
    rate = current_rate(optimizer)
    found = distributed_optimizers(model)
    if found is None:  # trains alone on each rank: nothing to agree on
        return rate
    ranks = found[1].ranks
    return broadcast_object(rate, root_rank=ranks[0] if ranks else 0,
                            name="keras_ring.initial_lr", process_set=found[1])


def log_rate(model: Any, logs: dict | None) -> None:
    """Puts the rate the epoch ended with into its logs (History, CSVLogger, TensorBoard),
    under Keras 3's key, as Horovod's callbacks did under ``lr``."""
    if logs is not None:
        logs["learning_rate"] = current_rate(model.optimizer)


def set_rate(optimizer: Any, rate: float, momentum_correction: bool) -> None:
    """Sets the rate; with momentum correction, rescales momentum buffers by new / old rate.

    SGD's and RMSprop's momentum buffers hold velocities that already include the learning
    rate (v = m * v - lr * g). When the rate changes, Goyal et al. (2017) scale v by
    new / old so the step after the change is the one the new rate would have produced.
    Every rank computes the same ratio from the same numbers, so buffers stay in sync.
    Other optimizers (Adam's moments do not include the rate) are left alone.
    """
    old = current_rate(optimizer)
    optimizer.learning_rate = float(rate)
    if not momentum_correction or old == 0.0 or old == rate:
        return
    for buffer in momentum_buffers(optimizer):
        buffer.assign(buffer * (rate / old))


def momentum_buffers(optimizer: Any) -> list:
    """The velocity variables that include the learning rate (SGD, RMSprop), else []."""
    inner = _innermost(optimizer)
    if isinstance(inner, keras.optimizers.SGD) and inner.momentum:
        return list(getattr(inner, "momentums", []) or [])
    if isinstance(inner, keras.optimizers.RMSprop) and inner.momentum:
        return list(getattr(inner, "_momentums", []) or [])
    return []


def steps_per_epoch(explicit: int | None, params: dict | None, who: str) -> int:
    steps = explicit if explicit is not None else (params or {}).get("steps")
    if not steps:
        raise ValueError(f"{who} needs the number of batches per epoch, and fit() does not "
                         "know it for this data (an infinite or unsized dataset): pass "
                         "steps_per_epoch=... to the callback")
    return int(steps)
