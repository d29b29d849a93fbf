"""What an elastic job keeps across worlds: committed in memory, restored after a failure,
synchronised from the new world's rank 0.

``commit()`` saves the state (a copy in host memory, no disk) and then asks whether new
workers wait; if they do, every rank raises ``HostsUpdatedInterrupt`` at that same commit
(rank 0 asks the rendezvous, the answer is broadcast), and ``keras_ring.elastic.run`` forms
the larger world. A failure between commits makes ``run`` restore the last commit.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from keras_ring import _adapted_state, _keras_private, _step_check
from keras_ring.basics import rank
from keras_ring.collectives import broadcast, broadcast_variables
from keras_ring.objects import allgather_object, broadcast_object
from keras_ring.runtime import RUNTIME


class HostsUpdatedInterrupt(RuntimeError):
    """Raised by ``commit()`` on every rank when new workers wait to join (caught by ``run``)."""


class State:
    """The base of every elastic state: commit, restore, sync and reset callbacks.

    Subclasses implement ``save``, ``restore`` and ``sync``.
    """

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: Sequence[Callable[[], None]]) -> None:
        """Functions to call after every change of world, before the state is synced (e.g.
        to recompute what depends on ``size()``, such as a learning rate)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Runs the reset callbacks (``run`` calls it after the world changed)."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def reset(self) -> None:
        """Adjusts the state itself to a new world (before the callbacks)."""

    def commit(self) -> None:
        """Saves the state, then raises ``HostsUpdatedInterrupt`` if new workers wait.

        Every rank must commit at the same point of the program (a collective runs here).
        """
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raises ``HostsUpdatedInterrupt`` on every rank if new workers wait to join."""
        client = RUNTIME.elastic
        if client is None:
            return  # not an elastic job: nobody can join
        waiting = client.updates_waiting() if rank() == 0 else False
        agreed = broadcast(tf.constant(int(waiting), tf.int32), 0,
                           name="keras_ring.elastic.updates")
        if int(agreed) != 0:
            raise HostsUpdatedInterrupt("new workers wait to join at this commit")

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError


class ObjectState(State):
    """Python values (counters such as ``epoch`` and ``batch``), exposed as attributes.

    Args:
        **kwargs: the values and their initial contents; any picklable value.

    Example:

    ```python
    state = keras_ring.elastic.ObjectState(epoch=0, batch=0)
    state.epoch += 1
    state.commit()
    ```
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self._saved: dict[str, Any] = copy.deepcopy(kwargs)
        self._set_attributes()

    def save(self) -> None:
        self._saved = {name: copy.deepcopy(getattr(self, name)) for name in self._saved}

    def restore(self) -> None:
        self._set_attributes()

    def sync(self) -> None:
        if self._saved:
            self._saved = broadcast_object(self._saved, 0, name="keras_ring.elastic.objects")
        self._set_attributes()

    def _set_attributes(self) -> None:
        for name, value in self._saved.items():
            setattr(self, name, copy.deepcopy(value))


class TensorFlowState(ObjectState):
    """Variables (``tf.Variable`` or ``keras.Variable``) and Python values.

    Args:
        variables: the variables to keep; every rank passes them in the same order.
        **kwargs: Python values, as in ``ObjectState``.

    Example:

    ```python
    state = keras_ring.elastic.TensorFlowState([w, b], step=0)
    ```
    """

    def __init__(self, variables: Sequence[Any] = (), **kwargs: Any) -> None:
        self.variables = list(variables)
        self._values: list[Any] = []
        super().__init__(**kwargs)
        self._save_variables()

    def save(self) -> None:
        self._save_variables()
        super().save()

    def restore(self) -> None:
        for variable, value in zip(self._tracked(), self._values):
            variable.assign(value)
        super().restore()

    def sync(self) -> None:
        tracked = self._tracked()
        counts = allgather_object(len(tracked), name="keras_ring.elastic.count")
        if len(set(counts)) > 1:
            raise ValueError(self._count_problem(counts))
        if tracked:
            broadcast_variables(tracked, 0)
            _step_check.note_synced(tracked)  # equal now: no step compares them again
        super().sync()
        self._save_variables(tracked)  # a restore after a failure comes back here at least

    def _tracked(self) -> list[Any]:
        return self.variables

    def _count_problem(self, counts: list[int]) -> str:
        return (f"keras_ring.elastic: the ranks keep different numbers of variables "
                f"(by rank: {counts}): every worker must build the same variables")

    def _save_variables(self, tracked: list[Any] | None = None) -> None:
        # One host copy per variable (numpy() may alias the variable's buffer; an identity
        # op first would only add a second copy).
        self._values = [np.array(v.numpy(), copy=True)
                        for v in (self._tracked() if tracked is None else tracked)]


class KerasState(TensorFlowState):
    """A Keras model's weights, its optimizer's variables, and Python values.

    The optimizer's variables are built when they do not exist yet, so that every rank
    keeps (and a newcomer receives) the same set. The model must be built (a
    ``keras.Input``, ``model.build(shape)``, or a call on data) before the first sync.

    Args:
        model: the model; its ``optimizer`` is used when ``optimizer`` is None.
        optimizer: the optimizer whose variables to keep, if not the model's.
        **kwargs: Python values, as in ``ObjectState`` (e.g. ``epoch=0, batch=0``).

    Example:

    ```python
    state = keras_ring.elastic.KerasState(model, epoch=0, batch=0)
    ```
    """

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        self.model = model
        self.optimizer = optimizer
        super().__init__((), **kwargs)

    def _tracked(self) -> list[Any]:
        model = self.model
        if _keras_private.unbuilt_layers(model):
            return []
        optimizer = self.optimizer or getattr(model, "optimizer", None)
        variables = list(model.weights)  # not the layers' random seeds: each rank keeps its own
        if optimizer is not None:
            if not optimizer.built and model.trainable_variables:
                optimizer.build(model.trainable_variables)
            variables += list(optimizer.variables)
        return variables

    def _count_problem(self, counts: list[int]) -> str:
        unbuilt = [r for r, c in enumerate(counts) if c == 0]
        if unbuilt:
            return (f"keras_ring.elastic.KerasState: the model of rank(s) {unbuilt} is not "
                    f"built (it has no variables; by rank: {counts}): build it before "
                    "training (give it a keras.Input, or call model.build(input_shape)), so "
                    "a new worker can receive the weights")
        return super()._count_problem(counts)

    def sync(self) -> None:
        super().sync()
        _adapted_state.refresh(self.model)  # Normalization's copy of the synced statistics

    def restore(self) -> None:
        super().restore()
        _adapted_state.refresh(self.model)

    def reset(self) -> None:
        # Traced steps may hold what the old world decided (its size, say): trace anew.
        _keras_private.forget_traced_functions(self.model)


class TensorFlowKerasState(KerasState):
    """Horovod's name for a Keras model's state in a TensorFlow custom loop (its TF2 elastic
    examples): :class:`KerasState`. ``backend`` (Horovod's Keras backend module) is accepted
    and not needed.

    Example:

    ```python
    state = keras_ring.elastic.TensorFlowKerasState(model, optimizer, batch=0, epoch=0)
    ```
    """

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None,
                 **kwargs: Any) -> None:
        del backend
        super().__init__(model, optimizer, **kwargs)
