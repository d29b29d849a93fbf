"""Shared by the learning-rate callbacks: which optimizers they set, reading and setting
their rates, momentum correction."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras

from keras_ring import _keras_private
from keras_ring._model_optimizers import (distributed_optimizers, refuse_training_apart,
                                          training_optimizers)
from keras_ring.objects import broadcast_object
from keras_ring.process_sets import global_process_set
from keras_ring.runtime import RUNTIME

Named = list[tuple[str, Any]]  # (name, optimizer): "optimizer", or the model's attribute


def optimizers_of(model: Any, who: str) -> Named:
    """The optimizers a learning-rate callback sets: ``model.optimizer`` for a model that
    keeps none as attributes (every model that Keras's own ``train_step`` trains); else the
    optimizers it keeps as attributes (keras-io's GAN: ``d_optimizer``, ``g_optimizer``),
    after the compiled one unless ``compile()`` chose that one itself, unasked (the RMSprop
    a GAN's ``super().compile()`` gets and its ``train_step`` never applies: setting only
    that one changed nothing, silently). As keras_ring's broadcast and checks count them,
    wrapped or not (a custom step may average through a ``DistributedGradientTape``); in
    the model's order, the same on every rank.
    """
    found = training_optimizers(model)
    if any(name != "optimizer" for name, _ in found):  # attributes: keras-io's GAN
        return found
    compiled = getattr(model, "optimizer", None)
    if compiled is None:
        raise ValueError(f"{who} needs a compiled model with an optimizer; "
                         f"{type(model).__name__}.optimizer is None")
    return [("optimizer", compiled)]


def describe(names: list[str], rates: list[float]) -> str:
    return ", ".join(f"{name}: {rate:g}" for name, rate in zip(names, rates))


def check_initial_lr(value: Any, number: Callable[[Any], float]
                     ) -> float | dict[str, float] | None:
    """``initial_lr`` as given: None, a number, or a dict of one per optimizer, by the name
    the model holds it under (``{"d_optimizer": 2e-4, "g_optimizer": 1e-4}``); ``number``
    checks each number (raising the callback's own ``ValueError``)."""
    if not isinstance(value, dict):
        return None if value is None else number(value)
    if not value or not all(isinstance(name, str) for name in value):
        raise ValueError("initial_lr as a dict maps the names the model holds its "
                         f"optimizers under to their rates, got {value!r}")
    return {name: number(rate) for name, rate in value.items()}


def initial_rates(model: Any, optimizers: Named, given: float | dict | None,
                  who: str) -> list[float]:
    """Each optimizer's initial rate (the one its warmup ends at, its schedule multiplies),
    in the order of ``optimizers``.

    Raises:
        ValueError: where one number is given for optimizers whose rates differ (it can be
            the initial rate of one of them at most: each would be warmed up or scheduled to
            it, silently; pass a dict), or a dict whose names are not the optimizers'.
    """
    names = [name for name, _ in optimizers]
    if given is None:
        return root_rates(model, [o for _, o in optimizers], who)
    if isinstance(given, dict):
        if sorted(given) != sorted(names):
            raise ValueError(f"{who}: initial_lr names {sorted(given)}, but "
                             f"{type(model).__name__} trains with the optimizers {names}")
        return [given[name] for name in names]
    # The root's rates decide, so that every rank raises alike (a checkpoint restored on the
    # root only may hold rates that differ where the others' are equal).
    rates = [current_rate(o) for _, o in optimizers]
    if len(rates) > 1:
        rates = _from_root(model, rates, "keras_ring.initial_lr_check")
    if len(set(rates)) > 1:
        raise ValueError(
            f"{who}: initial_lr={given:g} is one rate, but {type(model).__name__} trains "
            f"with optimizers of different rates ({describe(names, rates)}), and one number "
            "cannot be the initial rate of each. Pass initial_lr=None to take each one's own "
            "rate, or a dict of one rate per optimizer (initial_lr={"
            + ", ".join(f"{name!r}: ..." for name in names) + "})")
    return [given] * len(optimizers)


def start(model: Any, initial_lr: float | dict | None, who: str
          ) -> tuple[Named, list[float], float | dict[str, float]]:
    """What a learning-rate callback needs as training starts: the optimizers it sets
    (each checked settable), each one's initial rate, and what its ``initial_lr`` shows
    from then on (:func:`given_back`)."""
    refuse_training_apart(model, who, global_process_set)
    optimizers = optimizers_of(model, who)
    for name, optimizer in optimizers:
        check_settable(optimizer, who if len(optimizers) == 1 else f"{who} (for {name})")
    rates = initial_rates(model, optimizers, initial_lr, who)
    return optimizers, rates, given_back(optimizers, rates)


def one_rate(initial_lr: Any, given: float | None, who: str) -> float:
    """``given``, else the callback's ``initial_lr``, which must be one rate (a dict holds
    one per optimizer of a model that keeps several as attributes)."""
    rate = initial_lr if given is None else given
    if isinstance(rate, dict) or rate is None:
        raise ValueError(f"{who}.learning_rate_at needs initial_lr=, the rate of one "
                         f"optimizer: the callback's initial_lr is {rate!r}")
    return rate


def given_back(optimizers: Named, rates: list[float]) -> float | dict[str, float]:
    """What a callback's ``initial_lr`` shows once training started: the number for one
    optimizer, else a dict by name (what it would take to resume)."""
    if len(optimizers) == 1:
        return rates[0]
    return {name: rate for (name, _), rate in zip(optimizers, rates)}


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


def root_rates(model: Any, optimizers: list, who: str) -> list[float]:
    """The rates a callback given no ``initial_lr`` starts from: the root's (the first rank
    the model's keras_ring optimizers average over), one per optimizer. A checkpoint
    restored on the root only reaches the others with the broadcast, in the first batch,
    after ``on_train_begin``: each rank's own rate would make each warm up to its own,
    silently.

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
    return _from_root(model, [current_rate(optimizer) for optimizer in optimizers],
                      "keras_ring.initial_lr")


def _from_root(model: Any, rates: list[float], name: str) -> list[float]:
    """The root's ``rates`` (the first rank the model's keras_ring optimizers average over;
    a collective there), or this rank's where the model trains alone on each rank."""
    found = distributed_optimizers(model)
    if found is None:  # trains alone on each rank: nothing to agree on
        return rates
    ranks = found[1].ranks
    return broadcast_object(rates, root_rank=ranks[0] if ranks else 0, name=name,
                            process_set=found[1])


def log_rates(optimizers: Named, logs: dict | None) -> None:
    """Puts the rates the epoch ended with into its logs (History, CSVLogger, TensorBoard),
    as Horovod's callbacks did under ``lr``: under Keras 3's key ``learning_rate`` for one
    optimizer; for several (keras-io's GAN), one key each, prefixed with the optimizer's
    name as Keras prefixes a model's outputs' metrics (``d_optimizer_learning_rate``), and
    no ``learning_rate``, which would be one of them or the unused compiled one's."""
    if logs is None:
        return
    if len(optimizers) == 1:
        logs["learning_rate"] = current_rate(optimizers[0][1])
        return
    for name, optimizer in optimizers:
        logs[f"{name}_learning_rate"] = current_rate(optimizer)


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
