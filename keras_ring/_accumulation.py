"""Local gradient accumulation: Horovod's ``backward_passes_per_step``.

Each rank adds up the gradients of ``backward_passes_per_step`` backward passes locally and
the ranks communicate once, on the last pass. With ``average_aggregated_gradients=False``
(Horovod's default) the update gets the sum of the passes' gradients (reduced over ranks by
``op``); with True, that sum divided by the number of passes, i.e. the gradient of the
global batch of ``size() * passes * batch`` samples.

``wrap`` lets Keras accumulate (``gradient_accumulation_steps``, see ``keras_ring.optimizer``);
``DistributedGradientTape`` has no optimizer to lean on and keeps its own sums here.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import tensorflow as tf
# The variable class itself: constructing it skips the variable creators that a tf.function
# installs (see state_variable).
from tensorflow.python.ops.resource_variable_ops import ResourceVariable

from keras_ring._overwrite import combine_passes, overwrites


@dataclass(frozen=True)
class Passes:
    """Validated ``backward_passes_per_step`` and ``average_aggregated_gradients``."""

    steps: int = 1
    average: bool = False

    @classmethod
    def create(cls, who: str, backward_passes_per_step: Any,
               average_aggregated_gradients: Any) -> "Passes":
        steps = backward_passes_per_step
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"{who}: backward_passes_per_step must be an int >= 1, got "
                             f"{steps!r}")
        if not isinstance(average_aggregated_gradients, bool):
            raise TypeError(f"{who}: average_aggregated_gradients must be a bool, got "
                            f"{average_aggregated_gradients!r}")
        return cls(steps, average_aggregated_gradients)

    @property
    def sum_factor(self) -> int:
        """What Keras's average over accumulated passes must be multiplied by to give ours."""
        return self.steps if self.steps > 1 and not self.average else 1


def _ref(source: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(source)
    except TypeError:  # not weakly referenceable: hold it
        return lambda: source


class SourcesState:
    """State kept for one list of sources (variables), found again by them: a tape is
    usually made anew in every step, so what must outlive it lives in a registry of these."""

    def __init__(self, sources: Sequence[Any]) -> None:
        self._refs = [_ref(s) for s in sources]

    def alive(self) -> bool:
        return all(r() is not None for r in self._refs)

    def serves(self, sources: Sequence[Any]) -> bool:
        return len(sources) == len(self._refs) and all(
            r() is s for r, s in zip(self._refs, sources))


State = TypeVar("State", bound=SourcesState)


def state_for(registry: dict[tuple, State], key: tuple, sources: Sequence[Any],
              make: Callable[[], State]) -> State:
    """``registry``'s state for these sources (the same objects, in this order; ``key``
    holds their ids), made by ``make`` on first use."""
    found = registry.get(key)
    if found is None or not found.serves(sources):
        # Dead entries (sources garbage collected) would only hold memory: drop them too.
        for stale in [k for k, a in registry.items() if not a.alive()]:
            del registry[stale]
        found = registry[key] = make()
    return found


class Accumulator(SourcesState):
    """Per-source sums of gradients over passes, and the pass counter, for one list of sources.

    The variables are made outside any ``tf.function`` (``tf.init_scope``), so a step function
    that is traced again reuses them.
    """

    def __init__(self, sources: Sequence[Any], grads: Sequence[Any], steps: int) -> None:
        super().__init__(sources)
        self.steps = steps
        self.new_values = [overwrites(s) for s in sources]
        with tf.init_scope():
            self.sums = [None if g is None else _zeros_variable(g, i) for i, g in enumerate(grads)]
            self.count = state_variable(tf.constant(0, tf.int64), "keras_ring_backward_passes")

    def add(self, grads: Sequence[Any]) -> tuple[list[Any], tf.Tensor]:
        """Adds this pass's gradients; returns the sums so far and whether this pass updates."""
        totals: list[Any] = []
        for i, (total, grad) in enumerate(zip(self.sums, grads)):
            if total is None:
                if grad is not None:
                    raise ValueError(
                        f"keras_ring: source {i} had no gradient in the first backward pass "
                        "but has one now; with backward_passes_per_step every pass must "
                        "produce the same gradients")
                totals.append(None)
                continue
            if grad is not None:
                grad = tf.cast(tf.convert_to_tensor(grad), total.dtype)
                if self.new_values[i]:  # Keras keeps the passes' largest (float8 scales)
                    total.assign(combine_passes(True, grad, total))
                else:
                    total.assign_add(grad)
            totals.append(total)
        count = tf.convert_to_tensor(self.count.assign_add(1))
        return totals, tf.equal(tf.math.floormod(count, self.steps), 0)

    def reset(self) -> list[Any]:
        return [total.assign(tf.zeros_like(total)) for total in self.sums if total is not None]


def state_variable(initial_value: Any, name: str) -> tf.Variable:
    """A non-trainable variable of keras_ring's own, made outside any traced function.

    ``tf.Variable`` refuses, even under ``tf.init_scope``, while a ``tf.function`` is traced
    again after its first call: Horovod's elastic examples trace their step once without
    reducing (to build the optimizer), so the reduction's state is first needed then. The
    variable class made directly is not subject to that guard; later traces capture this one
    variable, which is what the guard is for.
    """
    with tf.init_scope():
        return ResourceVariable(initial_value, trainable=False, name=name)


def _zeros_variable(grad: Any, position: int) -> tf.Variable:
    shape = grad.dense_shape if isinstance(grad, tf.IndexedSlices) else grad.shape
    shape = tf.TensorShape(tf.get_static_value(shape) if isinstance(shape, tf.Tensor) else shape)
    if not shape.is_fully_defined():
        raise ValueError(f"keras_ring: backward_passes_per_step needs gradients of known shape, "
                         f"but source {position}'s gradient has shape {shape}")
    return state_variable(tf.zeros(shape, grad.dtype), "keras_ring_accumulated_gradient")


# (steps, ids of the sources) -> Accumulator. A tape is usually made anew in every step, so
# the sums live here, found again by the sources the gradients are taken for.
_ACCUMULATORS: dict[tuple, Accumulator] = {}


def accumulator_for(sources: Sequence[Any], grads: Sequence[Any], steps: int) -> Accumulator:
    """The accumulator of these sources (the same objects, in this order), made on first use."""
    return state_for(_ACCUMULATORS, (steps, tuple(id(s) for s in sources)), sources,
                     lambda: Accumulator(sources, grads, steps))


def drop_pending_passes() -> None:
    """Empties every ``DistributedGradientTape`` accumulator: the passes summed since its
    last update, and its pass counter. An elastic job calls it on every rank of each new
    world: a survivor's may hold a pass of a step that the restore rolled back, or count
    differently from a newcomer's, whose are empty (its next reduction would then meet
    another collective). Those passes are lost, as the steps since the last commit are."""
    for accumulator in list(_ACCUMULATORS.values()):
        if accumulator.alive():
            accumulator.reset()
            accumulator.count.assign(0)
