"""Gradients that stay on their rank: Horovod's local variables and local layers.

``PartialDistributedOptimizer`` and ``PartialDistributedGradientTape`` (and the
``register_local_var`` / ``register_local_source`` methods) name variables whose gradients
are not reduced: each rank applies its own. As in Horovod, those gradients are divided by
``size()`` by default (``scale_local_gradients=True``), so that they are the gradient of the
ranks' average loss, as the reduced ones are with ``op=Average``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import keras
import tensorflow as tf

from keras_ring._buckets import ReduceOptions, map_gradient, reduce_gradients
from keras_ring._grouping import is_variable, variable_keys
from keras_ring._overwrite import overwrites, reduce_new_values
from keras_ring.basics import size
from keras_ring.collectives import Min, allreduce


def check_local_layers(local_layers: Any, who: str) -> list[keras.layers.Layer]:
    """``local_layers`` (None, one layer or an iterable of layers) as a list of layers."""
    if local_layers is None:
        return []
    if isinstance(local_layers, keras.layers.Layer):
        return [local_layers]
    if isinstance(local_layers, (str, bytes)) or not isinstance(local_layers, Iterable):
        raise TypeError(f"{who}: local_layers must be a keras.layers.Layer or a list of them, "
                        f"got {type(local_layers).__name__}: {local_layers!r}")
    layers = list(local_layers)
    wrong = [layer for layer in layers if not isinstance(layer, keras.layers.Layer)]
    if wrong:
        raise TypeError(f"{who}: local_layers must all be keras.layers.Layer instances, got "
                        f"{type(wrong[0]).__module__}.{type(wrong[0]).__qualname__}: {wrong[0]!r}")
    return layers


def check_variable(variable: Any, who: str) -> Any:
    if not is_variable(variable):
        raise TypeError(f"{who} takes a tf.Variable or keras.Variable, got "
                        f"{type(variable).__module__}.{type(variable).__qualname__}: {variable!r}")
    return variable


class LocalSources:
    """The variables (or tape sources) whose gradients each rank keeps for itself.

    Layers are read each time gradients are reduced, not when they are named, so a layer
    that is built later (a model without an ``Input``) counts as soon as it has weights.

    Args:
        layers: layers whose trainable weights are local.
        scale: divide local gradients by ``size()`` (Horovod's ``scale_local_gradients``).
    """

    def __init__(self, layers: Sequence[keras.layers.Layer] = (), scale: bool = True) -> None:
        self.layers = list(layers)
        self.sources: list[Any] = []
        self.scale = scale

    def register(self, source: Any) -> None:
        self.sources.append(source)

    def keys(self) -> set[int]:
        keys: set[int] = set()
        for source in self.sources:
            keys |= variable_keys(source)
        for layer in self.layers:
            # All its weights: a frozen one of a local layer may differ by rank too (the
            # weight check compares frozen weights); untrained ones get no gradient anyway.
            for weight in layer.weights:
                keys |= variable_keys(weight)
        return keys


def check_scale(scale_local_gradients: Any, who: str) -> bool:
    if not isinstance(scale_local_gradients, bool):
        raise TypeError(f"{who}: scale_local_gradients must be a bool, got "
                        f"{scale_local_gradients!r}")
    return scale_local_gradients


def reduce_partially(grads: Sequence[Any], sources: Sequence[Any] | None, options: ReduceOptions,
                     local: LocalSources | None, name: str | None = None,
                     overflow_everywhere: bool = False) -> list[Any]:
    """``reduce_gradients``, except for the gradients of ``local`` sources, which stay here,
    and the new values of variables Keras overwrites with them (``_overwrite``), which take
    the ranks' maximum.

    ``sources`` are the variables (or tensors) in the order of ``grads``; None if unknown
    yet (then every gradient is reduced). ``overflow_everywhere`` (a loss-scale
    optimizer's): a non-finite local gradient on any rank makes every rank's local gradients
    non-finite, so every rank skips the step and lowers its scale alike.
    """
    name = name or options.name
    if sources is None:
        return reduce_gradients(grads, options, name)
    sources = list(sources)
    keys = local.keys() if local is not None else set()
    is_local = [bool(keys) and bool(variable_keys(s) & keys) for s in sources]
    is_new = [overwrites(s) for s in sources]
    if not any(is_local) and not any(is_new):
        return reduce_gradients(grads, options, name, sources)
    # Those positions become None, which reduce_gradients skips: buckets and their names
    # stay those of the shared gradients alone, the same on every rank.
    shared = reduce_gradients([None if mine or new else g
                               for g, mine, new in zip(grads, is_local, is_new)],
                              options, name, sources)
    newest = reduce_new_values([g if new and not mine else None
                                for g, mine, new in zip(grads, is_local, is_new)], options, name)
    n = (options.process_set.size() or size()) if local is not None and local.scale else 1
    out = [(g if new or n == 1 else map_gradient(g, lambda v: v / n)) if mine
           else (m if new else r)
           for g, mine, new, r, m in zip(grads, is_local, is_new, shared, newest)]
    if overflow_everywhere:
        out = _overflow_everywhere(out, is_local, options, name)
    return out


def _overflow_everywhere(grads: list[Any], is_local: list[bool], options: ReduceOptions,
                         name: str) -> list[Any]:
    # The reduced gradients are the same everywhere, the local ones are not: without this a
    # rank whose own layer overflowed would skip a step the others take.
    mine = [g for g, local in zip(grads, is_local) if local and g is not None]
    if not mine:
        return grads
    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(_values(g))) for g in mine])
    everywhere = allreduce(tf.cast(finite, tf.int32), op=Min, name=f"{name}.local_finite",
                           process_set=options.process_set)

    def poisoned(v):
        return tf.where(everywhere > 0, v, tf.fill(tf.shape(v), tf.constant(float("nan"), v.dtype)))

    return [map_gradient(g, poisoned) if local else g for g, local in zip(grads, is_local)]


def _values(grad: Any) -> Any:
    return grad.values if isinstance(grad, tf.IndexedSlices) else tf.convert_to_tensor(grad)
