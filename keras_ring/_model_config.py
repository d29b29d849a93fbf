"""What a model computes besides its weights: each layer's class, configuration and dtype
policy, compared as ``fit`` begins.

Ranks that load different checkpoints, or build the model from different settings, may hold
weights of the same shapes and still compute different things (``tanh`` where the others
have ``relu``, one ``Dropout`` more, ``mixed_bfloat16`` on one rank): the broadcast makes the
weights equal and the weight check passes, while each rank computes its gradients with its
own model and the averaged update trains none of them, silently. ``fit``'s epoch check
carries a 48-bit :func:`digest` of every layer's description from the first epoch; where it
differs, :func:`mismatch` names the first layer that differs, and how, on every rank.

Only Keras's own layers are compared by their configuration; a layer of the program's own
class by its class and dtype policy (its constructor's arguments may be the rank's own: a
log directory, the rank itself). Left out, since one program may differ there by rank: names
(Keras numbers layers as they are made), seeds (each rank draws its own masks and initial
values), batch sizes and build shapes (uneven batches), trainable flags (the weight check
tells those apart, by weight), the wiring of functional models (it is written in layer
names), a ``Lambda``'s function (marshaled with its file's path, which may differ by host,
and with the values it closes over), and objects inside a configuration beyond their type.
"""

from __future__ import annotations

from typing import Any

from keras_ring import _keras_private
from keras_ring._optimizer_settings import canonical, differences
from keras_ring._optimizer_settings import digest as _digest
from keras_ring.errors import WeightMismatchError
from keras_ring.objects import allgather_object
from keras_ring.process_sets import ProcessSet

_RANK_OWN = frozenset({
    "name", "seed", "trainable", "batch_shape", "batch_size", "batch_input_shape",
    "build_config", "build_input_shape", "inbound_nodes", "input_layers", "output_layers",
    "layers",  # a container's layers are described one by one
    "function"})  # a Lambda's, marshaled: its file's path and the values it closes over
_COMPARED = frozenset({"keras", "keras_ring"})  # top packages whose layers' configs are compared
_CLASS = "class"
_POLICY = "dtype policy"


def _describe(layer: Any) -> dict:
    """The layer's class, dtype policy and, for Keras's own layers, canonical configuration
    (without _RANK_OWN)."""
    cls = type(layer)
    try:
        config = (canonical(layer.get_config(), _RANK_OWN, opaque=True)
                  if cls.__module__.split(".")[0] in _COMPARED else {})
    except Exception as e:  # noqa: BLE001 - every rank must still take part in the check
        config = f"no get_config ({type(e).__name__})"
    found = config if isinstance(config, dict) else {"config": config}
    found.pop("dtype", None)  # a serialized policy, its name left out with the others: below
    return {**found, _CLASS: f"{cls.__module__}.{cls.__qualname__}",
            _POLICY: getattr(getattr(layer, "dtype_policy", None), "name", None)}


def _described(model: Any) -> list[tuple[str, dict]]:
    """(name, description) of each layer of ``model``, nested ones too, the model first."""
    return [(layer.name, _describe(layer)) for layer in _keras_private.nested_layers(model)]


def digest(model: Any) -> float:
    """48 bits of the hash of every layer's description (exact in a float64)."""
    return _digest([d for _, d in _described(model)])


def mismatch(model: Any, ranks: list[int],
             process_set: ProcessSet) -> WeightMismatchError | None:
    """The error for digests that differ (every rank calls this alike: one allgather); None
    where the models' weights differ in count, dtype or shape too: the weight check, at the
    first step, names that difference, which says more."""
    shapes = [(tuple(w.shape), str(w.dtype)) for w in model.weights]
    gathered = allgather_object((shapes, _described(model)), name="keras_ring.model_config",
                                process_set=process_set)
    if any(g[0] != gathered[0][0] for g in gathered):
        return None
    # Compared as the digest was taken: descriptions by repr (a NaN setting equals itself
    # there), names not at all.
    everyone = [[repr(d) for _, d in g[1]] for g in gathered]
    odd = next((i for i in range(1, len(everyone)) if everyone[i] != everyone[0]), None)
    if odd is None:  # the digests differed over equal descriptions: not expected
        return None
    first, other = gathered[0][1], gathered[odd][1]
    at = next((j for j in range(min(len(first), len(other)))
               if everyone[0][j] != everyone[odd][j]), None)
    if at is None:
        shown = (f"rank {ranks[0]}'s has {len(first)} layers, rank {ranks[odd]}'s "
                 f"{len(other)}")
    else:
        shown = (f"layer {at} of Keras's walk through the model (the model is 0), "
                 f"'{first[at][0]}' on rank {ranks[0]} and '{other[at][0]}' on rank {ranks[odd]}: "
                 + differences(first[at][1], other[at][1], ranks[0], ranks[odd], _CLASS))
    return WeightMismatchError.about(
        ranks[odd],
        f"keras_ring: the ranks' models '{model.name}' are built differently as fit begins "
        f"({shown}): each rank would compute its gradients with its own model, and the "
        "averaged update trains none of them (their weights have the same shapes, so the "
        "broadcast and the weight check pass). Build or load the same model on every rank: "
        "the same checkpoint, layers, activations and dtype policy (names, seeds, batch "
        "sizes and trainable flags may differ). KERAS_RING_CHECK_WEIGHTS=0 (on every rank) "
        "turns this check off, with the weight checks.")
