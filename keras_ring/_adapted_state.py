"""What Keras preprocessing layers learn by ``adapt()``, where no weight check sees it.

Programs written for one process adapt a preprocessing layer on the training data; moved to
N ranks they often adapt it on each rank's shard. Two kinds of state come out of that:

- ``Normalization`` keeps its mean and variance in variables, which the broadcast makes equal,
  and a copy of them, made by ``finalize_state()``, that its ``call`` reads. Nothing refreshed
  the copy after a broadcast, so each rank went on normalizing with its own statistics
  (silently: the weights compared equal). :func:`refresh` does what Keras's own loader does
  after assigning those variables; it runs after every broadcast of a model's variables and
  as ``fit`` begins.
- Lookup vocabularies (``StringLookup``, ``IntegerLookup``, ``TextVectorization``), their
  tf-idf weights (in a ``tf.Variable`` of the layer's own, outside its weights) and
  ``Discretization``'s bin boundaries are no Keras variables: no broadcast can make them
  equal, and ranks whose token ids (or token weights) mean different things train one
  model on both meanings. ``fit``'s epoch check carries a 48-bit :func:`digest` of them from the first
  epoch; where it differs, :func:`mismatch` names the layer on every rank.
"""

from __future__ import annotations

from typing import Any

import keras

from keras_ring import _keras_private
from keras_ring._optimizer_settings import digest as _digest
from keras_ring.errors import WeightMismatchError
from keras_ring.objects import allgather_object
from keras_ring.process_sets import ProcessSet

_SHOWN = 4  # entries of a vocabulary shown in the error


def refresh(model: Any) -> None:
    """Makes every ``Normalization`` layer of ``model`` use its variables' present values
    (it does nothing where the layer was given ``mean`` and ``variance`` or is not built)."""
    for layer in _keras_private.nested_layers(model):
        if isinstance(layer, keras.layers.Normalization):
            layer.finalize_state()


def _states(model: Any) -> list[tuple[str, str, list]]:
    """(layer name, what it holds, the values) for each adapted state outside variables."""
    found = []
    layers = _keras_private.nested_layers(model)
    # A TextVectorization's own lookup: its state is the owner's, named by the owner.
    inner = {id(lookup) for lookup in map(_keras_private.text_vectorization_lookup, layers)
             if lookup is not None}
    for layer in layers:
        if id(layer) in inner:
            continue
        if isinstance(layer, (keras.layers.StringLookup, keras.layers.IntegerLookup,
                              keras.layers.TextVectorization)):
            found.append((layer.name, "vocabulary", [str(v) for v in layer.get_vocabulary()]))
            idf = _keras_private.idf_weights(layer)
            if idf is not None:  # output_mode="tf_idf": what each token counts for
                found.append((layer.name, "idf weights", [float(w) for w in idf]))
        elif isinstance(layer, keras.layers.Discretization):
            bins = getattr(layer, "bin_boundaries", None)
            found.append((layer.name, "bin boundaries",
                          [] if bins is None else [float(b) for b in bins]))
    return found


def digest(model: Any) -> float:
    """48 bits of the hash of the adapted state outside variables (exact in a float64);
    0.0 for a model without any."""
    states = _states(model)
    return _digest([values for _, _, values in states]) if states else 0.0


def mismatch(model: Any, ranks: list[int], process_set: ProcessSet) -> WeightMismatchError:
    """The error for digests that differ (every rank calls this alike: one allgather)."""
    mine = [(name, what, len(values), _digest(values), values[:_SHOWN])
            for name, what, values in _states(model)]
    everyone = allgather_object(mine, name="keras_ring.adapted_state", process_set=process_set)
    odd = next((i for i in range(1, len(everyone)) if everyone[i] != everyone[0]), 1)
    first, other = everyone[0], everyone[odd]
    at = next((j for j in range(min(len(first), len(other))) if first[j] != other[j]), None)
    if at is None:  # different layers altogether
        shown = (f"rank {ranks[0]} has {[f[0] for f in first]}, "
                 f"rank {ranks[odd]} {[o[0] for o in other]}")
    else:
        name, what = first[at][0], first[at][1]
        shown = (f"layer '{name}', its {what}: rank {ranks[0]} {first[at][2]} entries "
                 f"{first[at][4]}..., rank {ranks[odd]} {other[at][2]} entries "
                 f"{other[at][4]}...")
    error = WeightMismatchError.about(
        ranks[odd],
        f"keras_ring: the ranks' preprocessing layers of model '{model.name}' hold different "
        f"adapted state as fit begins ({shown}): each rank adapted them on its own data, so "
        "the same input means different things on different ranks, and no broadcast can mend "
        "it (a vocabulary, tf-idf weights or bin boundaries are not variables). Adapt them "
        "on the same data on every rank (the whole dataset, before sharding it), or adapt on "
        "rank 0 and give the others its vocabulary: layer.set_vocabulary(keras_ring."
        "broadcast_object(layer.get_vocabulary(), 0)), in output_mode='tf_idf' with "
        "idf_weights=, rank 0's too. KERAS_RING_CHECK_WEIGHTS=0 (on every rank) turns this "
        "check off.")
    return error
