"""Every private Keras attribute keras_ring reads, in one place, with the versions that have it.

Keras has no public API for an optimizer's raw step counter, its gradient accumulators or a
model's build-before-the-first-step hook; keras_ring reads them here and nowhere else. The
supported range starts at the first Keras 3 that has all of them (3.5.0, where the
TensorFlow trainer gained ``_maybe_symbolic_build`` and optimizers a raw ``_iterations``);
:func:`check_supported` refuses anything older (and a backend other than TensorFlow) when
keras_ring starts, and :func:`check_accumulation` refuses an optimizer that lacks them at
``wrap()`` time, so a Keras that renames them fails early with a message, never with an
AttributeError mid-fit.
(``SyncBatchNormalization`` overrides BatchNormalization's private ``_moments``; it checks in
every training call that Keras called it, so a Keras that stops doing so is an error there,
never local statistics.)
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

MIN_TENSORFLOW = (2, 16)
MIN_KERAS = (3, 5, 0)


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit()) if not piece.isdigit() else piece
        if not digits:
            break
        parts.append(int(digits))
        if not piece.isdigit():  # "0rc1": the release candidate still counts as its number
            break
    return tuple(parts)


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


def version_problem(tf_version: str, keras_version: str) -> str | None:
    """What is wrong with this TensorFlow/Keras pair for keras_ring, or None when supported."""
    if _version_tuple(tf_version) < MIN_TENSORFLOW:
        return (f"keras_ring needs TensorFlow >= {_dotted(MIN_TENSORFLOW)} (the first with "
                f"Keras 3); this environment has TensorFlow {tf_version}. "
                f"Upgrade: pip install -U 'tensorflow>={_dotted(MIN_TENSORFLOW)}'")
    if _version_tuple(keras_version) < MIN_KERAS:
        return (f"keras_ring needs Keras >= {_dotted(MIN_KERAS)}; this environment has Keras "
                f"{keras_version} (older Keras 3 builds a model without an Input only inside "
                "its first traced step, after the initial weights must be broadcast). "
                f"Upgrade: pip install -U 'keras>={_dotted(MIN_KERAS)}' (it works with every "
                f"TensorFlow from {_dotted(MIN_TENSORFLOW)})")
    return None


def backend_problem(backend: str) -> str | None:
    """What is wrong with this Keras backend for keras_ring, or None for TensorFlow's."""
    if backend == "tensorflow":
        return None
    # Under another backend a wrapped optimizer gets that backend's arrays (JAX tracers, say),
    # which TensorFlow ops cannot reduce: refuse before training instead of failing inside it.
    return (f"keras_ring needs Keras's TensorFlow backend; this process runs Keras with the "
            f"{backend!r} backend (the KERAS_BACKEND variable, or 'backend' in "
            "~/.keras/keras.json). Set KERAS_BACKEND=tensorflow before Python starts")


def check_supported() -> None:
    """Raises ImportError naming the minimum when TensorFlow or Keras is too old, or naming
    the backend when Keras runs on one other than TensorFlow."""
    import os

    try:
        import keras
    except ImportError as e:  # KERAS_BACKEND=jax without JAX: Keras imports it first
        backend = os.environ.get("KERAS_BACKEND", "")
        if not backend or backend == "tensorflow":
            raise
        raise ImportError(f"{backend_problem(backend)}; with {backend!r} Keras could not even "
                          f"be imported here ({type(e).__name__}: {e})") from e
    import tensorflow as tf

    problem = (version_problem(tf.__version__, keras.__version__)
               or backend_problem(keras.backend.backend()))
    if problem:
        raise ImportError(problem)


def check_accumulation(optimizer: Any) -> None:
    """Refuses, at ``wrap()`` time, gradient accumulation on an optimizer whose internals
    keras_ring cannot read (a Keras that renamed them, or a foreign optimizer class)."""
    missing = [name for name in ("_iterations", "_get_variable_index")
               if not hasattr(optimizer, name)]
    if missing:
        import keras

        raise ValueError(
            f"keras_ring: {type(optimizer).__name__}(gradient_accumulation_steps="
            f"{optimizer.gradient_accumulation_steps}) cannot be wrapped with this Keras "
            f"({keras.__version__}): the optimizer has no {', '.join(missing)}, which keras_ring "
            "reads to communicate once per update. Use Keras "
            f">= {_dotted(MIN_KERAS)}, or accumulate without gradient_accumulation_steps.")


def raw_iterations(optimizer: Any) -> Any:
    """The optimizer's count of ``apply`` calls (micro-batches), not divided by the
    accumulation steps as the public ``iterations`` is."""
    return optimizer._iterations


def accumulators(optimizer: Any, variables: list) -> list:
    """Keras's gradient accumulator for each variable, in the order given."""
    return [optimizer._accumulated_gradients[optimizer._get_variable_index(v)]
            for v in variables]


def built_variables(optimizer: Any) -> list:
    """The variables a built optimizer was built for."""
    return optimizer._trainable_variables


def held_optimizers(model: Any) -> list[tuple[str, Any]]:
    """(attribute name, optimizer) for each optimizer ``model`` holds as an attribute besides
    its compiled one (keras-io's GAN: ``d_optimizer``, ``g_optimizer``), also inside a list,
    tuple or dict attribute (``optimizers[1]``, ``opts['d']``), in the order the model set
    them (the same on every rank)."""
    import keras

    seen = {id(getattr(model, "optimizer", None))}
    found = []
    for name, value in vars(model).items():
        if name.startswith("_") and isinstance(value, (dict, list, tuple)):
            continue  # Keras's and TensorFlow's own bookkeeping (their dependency tables)
        if isinstance(value, dict):
            entries = [(f"{name}[{key!r}]", item) for key, item in value.items()]
        elif isinstance(value, (list, tuple)):
            entries = [(f"{name}[{i}]", item) for i, item in enumerate(value)]
        else:
            entries = [(name, value)]
        for entry, item in entries:
            if isinstance(item, keras.optimizers.Optimizer) and id(item) not in seen:
                seen.add(id(item))
                found.append((entry, item))
    return found


def sub_optimizers(optimizer: Any) -> list | None:
    """A ``keras.optimizers.MultiOptimizer``'s sub-optimizers (Keras 3.13 and later), also
    inside a ``LossScaleOptimizer``; None for any other optimizer. A MultiOptimizer given a
    function learns them only as it is built: before that the list may be empty."""
    import keras

    multi = getattr(keras.optimizers, "MultiOptimizer", None)
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    if multi is None or not isinstance(optimizer, multi):
        return None
    return list(optimizer.optimizers)


def has_call(layer: Any) -> bool:
    """Whether the layer's class implements ``call``. A model that only overrides
    ``train_step`` (keras-io's VAE and GAN examples) has none: nothing ever builds it, and
    Keras on TensorFlow trains it with ``built`` False."""
    import keras

    return getattr(type(layer), "call", None) not in (keras.Model.call, keras.layers.Layer.call)


def keras_train_step(model: Any) -> bool:
    """Whether the model trains with Keras's own ``train_step`` (no class of the program's
    overrides it)."""
    owner = next((k for k in type(model).__mro__ if "train_step" in vars(k)), None)
    return owner is not None and owner.__module__.startswith("keras.")


def default_build(layer: Any) -> bool:
    """Whether the layer's class keeps Keras's own ``build`` (marked ``_is_default``), which
    for a subclassed model only marks it built, without running ``call()``."""
    return bool(getattr(type(layer).build, "_is_default", False))


def unbuilt_layers(model: Any) -> list:
    """The layers of the model (itself and nested ones) that have no variables yet because
    they have not run. Left out, since building them makes no variable: those without a
    ``call`` (what they hold are other layers, listed on their own, and variables made in
    ``__init__``, which exist) and those without a ``build`` of their own (lookups, Dropout:
    Keras refuses variables made after building). ``TextVectorization``'s lookup is one
    that never runs as a layer: its owner calls it by method."""
    return [layer for layer in nested_layers(model)
            if not layer.built and has_call(layer) and _builds_variables(layer)]


def _builds_variables(layer: Any) -> bool:
    """Whether building the layer may make variables: its class has a ``build`` of its own,
    or it is a model (whose variables its layers' builds make)."""
    import keras

    return isinstance(layer, keras.Model) or type(layer).build is not keras.layers.Layer.build


def text_vectorization_lookup(layer: Any) -> Any:
    """The lookup layer inside a ``TextVectorization`` (it holds the vocabulary and the
    tf-idf weights), or None."""
    return getattr(layer, "_lookup_layer", None)


def idf_weights(layer: Any) -> Any:
    """A lookup's (or ``TextVectorization``'s) tf-idf weights, as NumPy, where its
    ``output_mode`` is ``"tf_idf"`` and it has them; else None. Keras keeps them in a
    ``tf.Variable`` of the layer's own, outside its weights: no broadcast reaches them."""
    lookup = text_vectorization_lookup(layer)
    lookup = layer if lookup is None else lookup
    if getattr(lookup, "output_mode", None) != "tf_idf":
        return None
    weights = getattr(lookup, "idf_weights", None)
    return None if weights is None else np.asarray(weights)


def frozen_weights(model: Any) -> list:
    """The model's frozen weights, in ``model.weights`` order: made trainable, no longer
    trainable (their layer's ``trainable`` set False, or their own). Keras keeps them in a
    layer's list of trainable variables; state made non-trainable (BatchNormalization's
    moving statistics, a stateful RNN's states) is in another list and not among them."""
    frozen = {id(v) for layer in nested_layers(model)
              for v in getattr(layer, "_trainable_variables", ()) if not v.trainable}
    return [w for w in model.weights if id(w) in frozen]


def nested_layers(model: Any) -> list:
    """The model itself and every layer inside it, nested ones too (Keras's own walk)."""
    return list(model._flatten_layers())


def forget_traced_functions(model: Any) -> None:
    """Makes the next fit/evaluate/predict trace its step anew (Keras keeps the traced
    functions in these attributes and makes new ones when they are None)."""
    for name in ("train_function", "test_function", "predict_function"):
        if hasattr(model, name):
            setattr(model, name, None)


def fit_leftovers(values: Any) -> list:
    """``values``, with the validation iterator of each model among them that a fit which
    never reached its end left on it (taken off the model)."""
    import keras

    leftovers = list(values)
    for value in list(leftovers):
        if (isinstance(value, keras.Model)
                and getattr(value, "_eval_epoch_iterator", None) is not None):
            leftovers.append(value._eval_epoch_iterator)  # fit drops it at its end
            value._eval_epoch_iterator = None
    return leftovers


def reset_epoch_iterators(values: Any) -> None:
    """Resets each Keras epoch iterator in ``values``: its ``tf.data`` iterator, held in a
    cycle by its suspended epoch generator, is dropped now."""
    from keras.src.trainers.epoch_iterator import EpochIterator  # in every Keras 3

    for value in values:
        if isinstance(value, EpochIterator):
            if hasattr(value, "reset"):
                value.reset()
            else:  # Keras 3.5-3.x: no reset(); the epoch generator was fit's own local
                value._current_iterator = None


def first_batch(epoch_iterator: Any) -> Any:
    """What a symbolic build needs of a Keras TensorFlow epoch iterator's first batch.

    Where the iterator's dataset has an element spec of known ranks (what the train step is
    traced from anyway), that spec: nothing is read, so nothing is lost. Taking a real batch
    lost it where the adapter prefetches across ``reset()`` (a ``PyDataset`` with workers):
    every epoch then trained one batch behind. Otherwise the first batch, as Keras's own
    symbolic build takes it: 3.5-3.x hand out ``(step, iterator)`` from
    ``enumerate_epoch()``, newer ones ``(begin, end, iterator)`` when iterated."""
    spec = getattr(getattr(epoch_iterator, "_distributed_dataset", None), "element_spec", None)
    if spec is not None and _known_ranks(spec):
        return spec
    entries = (epoch_iterator.enumerate_epoch() if hasattr(epoch_iterator, "enumerate_epoch")
               else epoch_iterator)
    for entry in entries:
        return next(entry[-1])
    return None


def _known_ranks(spec: Any) -> bool:
    import tensorflow as tf

    shapes = [getattr(leaf, "shape", None) for leaf in tf.nest.flatten(spec)]
    return bool(shapes) and all(
        isinstance(shape, tf.TensorShape) and shape.rank is not None for shape in shapes)


@functools.cache
def variable_classes() -> tuple[type, ...]:
    """What a Keras variable is an instance of. Before Keras 3.6 or so, ``keras.Variable`` is
    an export subclass that the backend's variables (what layers make) are not instances of;
    the backend-independent base class in ``keras.src.backend.common.variables`` is common to
    all, so both are accepted."""
    import keras

    base = [c for c in keras.Variable.__mro__
            if c.__module__ == "keras.src.backend.common.variables"]
    return (keras.Variable, *base[:1])


def is_seed_state(variable: Any) -> bool:
    """Whether ``variable`` is the state of a ``keras.random.SeedGenerator`` (what Dropout,
    GaussianNoise and the Random* augmentation layers draw from). Keras lists these in a
    layer's ``variables``, not in its ``weights``, and names them so in every Keras 3."""
    return (isinstance(variable, variable_classes()) and not variable.trainable
            and variable.name == "seed_generator_state")


def is_gradient_accumulator(variable: Any) -> bool:
    """Whether ``variable`` is one of the sums an optimizer with ``gradient_accumulation_steps``
    keeps between updates (``add_variable_from_reference(..., "gradient_accumulator")``,
    named ``<variable>_gradient_accumulator`` in every Keras 3)."""
    return (isinstance(variable, variable_classes()) and not variable.trainable
            and variable.name.endswith("gradient_accumulator"))


def is_step_counter(variable: Any) -> bool:
    """Whether ``variable`` is an optimizer's count of ``apply`` calls (``iterations``' raw
    counter, named ``iteration`` in every Keras 3)."""
    return (isinstance(variable, variable_classes()) and not variable.trainable
            and variable.name == "iteration" and variable.dtype == "int64")


def has_symbolic_build(model: Any) -> bool:
    return hasattr(model, "_maybe_symbolic_build") and hasattr(model, "_symbolic_build")
