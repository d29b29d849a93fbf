"""Every rank trains the same model: a check that the ranks' weights agree, once per model
and ``init()``, before the second training step of ``fit``/``train_on_batch``.

Ranks that start from different weights (no ``BroadcastGlobalVariablesCallback``, a
checkpoint restored on one rank only) never fail by themselves: the averaged gradients move
every rank's weights alike, so the difference stays for good, and the model saved from rank
0 is one of several that trained. The check runs before the second step, not the first, so a
program that broadcasts after its first batch (as Horovod's older callback did) passes.

It compares per-weight fingerprints: the sum of the weight's bit patterns as unsigned
integers. Such a sum is exact in any order, so equal weights give equal fingerprints whatever the
thread count, host or kernel that sums them; different random initialisations essentially
never do. One allgather of one int64 per weight; nothing is added to the training step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from keras_ring.collectives import allgather
from keras_ring.errors import WeightMismatchError
from keras_ring.process_sets import ProcessSet, global_process_set
from keras_ring.runtime import RUNTIME

_INSTALLED = "_keras_ring_weight_check"
NAME = "keras_ring.weight_check"  # the collective's name, seen in errors beside the other side's
_SHOWN = 3  # weights named in the error


def install(model: Any, settings: Callable[[], tuple[set[int], ProcessSet] | None]) -> None:
    """Makes the training function of ``model`` check, before its second step after each
    ``init()``, that every rank holds the same trainable weights. ``settings()``, asked at
    that moment (the model may have been compiled again since), gives the ids of variables
    left out (local layers' weights differ by design) and the process set that trains, or
    None when the model's optimizer no longer communicates.
    """
    if getattr(model, _INSTALLED, False) or not hasattr(model, "make_train_function"):
        return
    original = model.make_train_function
    # Steps completed since the last init(): a step that failed (a mismatch the gradients'
    # collective reported) does not count, so the check still follows one finished step.
    steps = {"generation": None, "done": 0}

    def checked(function):
        def train_function(*args, **kwargs):
            generation = RUNTIME.generation
            if steps["generation"] != generation:
                steps["generation"], steps["done"] = generation, 0
            if steps["done"] == 1 and RUNTIME.config.check_weights:
                current = settings()
                if current is not None:
                    check_same_weights(model, *current)
            result = function(*args, **kwargs)
            steps["done"] += 1
            return result

        train_function._keras_ring_checked = function  # (a tf.function has __wrapped__)
        return train_function

    def make_train_function(force: bool = False):
        result = original(force=force)
        function = model.train_function  # Keras sets it; some versions also return it
        if function is not None and not hasattr(function, "_keras_ring_checked"):
            model.train_function = checked(function)
        return model.train_function if result is not None else result

    model.make_train_function = make_train_function
    setattr(model, _INSTALLED, True)


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


def _label(variable: Any) -> str:
    return str(getattr(variable, "path", None) or variable.name)


def check_same_weights(model: Any, local: set[int],
                       process_set: ProcessSet = global_process_set) -> None:
    """Raises ``WeightMismatchError`` on every rank of ``process_set`` when their trainable
    weights (except those with ids in ``local``) differ; a collective: every rank calls it."""
    ranks = process_set.ranks or list(range(RUNTIME.topology().size))
    if len(ranks) < 2:
        return
    variables = [v for v in model.trainable_variables
                 if id(v) not in local and id(getattr(v, "value", None)) not in local]
    with tf.init_scope():  # eager, also when called while a function traces
        mine = tf.stack([fingerprint(v.value if isinstance(v, keras.Variable) else v)
                         for v in variables] or [tf.constant(0, tf.int64)])
        everyone = allgather(mine[tf.newaxis], name=NAME, process_set=process_set).numpy()
    differs = (everyone != everyone[0]).any(axis=0)
    if not differs.any():
        return
    odd = [ranks[i] for i in range(1, len(ranks)) if (everyone[i] != everyone[0]).any()]
    names = [_label(v) for v, d in zip(variables, differs) if d]
    shown = ", ".join(f"'{n}'" for n in names[:_SHOWN]) + (", ..." if len(names) > _SHOWN else "")
    raise WeightMismatchError(
        f"keras_ring: the ranks are training different models: before the second training "
        f"step of model '{model.name}', {len(names)} of {len(variables)} trainable weights "
        f"({shown}) differ between rank {ranks[0]} and rank(s) "
        f"{', '.join(map(str, odd))}. Averaged gradients never remove such a difference. "
        "Start every rank from the same weights: put "
        "keras_ring.callbacks.BroadcastGlobalVariablesCallback(0) in fit's callbacks (or call "
        "keras_ring.broadcast_variables(model.variables, root_rank=0) before training); "
        "weights meant to differ belong to the local_layers of a "
        "PartialDistributedOptimizer. KERAS_RING_CHECK_WEIGHTS=0 turns this check off.")
