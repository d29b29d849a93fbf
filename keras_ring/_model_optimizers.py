"""The Keras models that wrapped optimizers train: ``Model.compile``'s hook, and which of a
model's optimizers keras_ring wraps.

A model compiled with a wrapped optimizer needs fixing up (XLA off, built before its first
step, weights checked across ranks); a model that keeps optimizers as attributes (keras-io's
GAN) trains with those. The callbacks and the checks ask here which optimizers train a model
and over which ranks they average.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
import weakref
from typing import Any

import keras
import tensorflow as tf

from keras_ring import _failed_calls, _keras_private, _rate_check, _weight_check, _xla
from keras_ring._accumulation import Passes
from keras_ring.optimizer import _STATE, _wrap_in_place, is_wrapped
from keras_ring.process_sets import ProcessSet
from keras_ring.runtime import RUNTIME

_compile_hook_installed = False
# In a compiled model's __dict__ (not tracked by Keras): a weak reference to the optimizer
# compile() chose when given none (None otherwise). Compared by identity: a custom compile()
# that calls super().compile() and then sets self.optimizer (keras-io's VAE) trains with that.
_COMPILE_DEFAULT = "_keras_ring_compile_default"
# In a model's __dict__: True once compiled with a wrapped optimizer; "warned" once a later
# compile without one was said to train apart.
_COMPILED_WRAPPED = "_keras_ring_compiled_wrapped"


def install_compile_hook() -> None:
    """Wraps ``Model.compile`` once, to fix up models compiled with wrapped optimizers (and
    to accept Horovod-era ``experimental_run_tf_function=``, which Keras 3 no longer has)."""
    global _compile_hook_installed
    if _compile_hook_installed:
        return
    # Patched on the class that defines compile, not on keras.Model: Keras's load_model
    # compiles a loaded model only when its class's compile is that one (a model class
    # that overrides compile gets a warning and no optimizer).
    owner = next(klass for klass in keras.Model.__mro__ if "compile" in vars(klass))
    original = owner.compile
    signature = inspect.signature(original)

    @functools.wraps(original)
    def compile(self, *args, **kwargs):
        # Horovod's Keras examples pass it (TF 2.x Keras needed it to use the distributed
        # optimizer); Keras 3 always does and has no such argument, so a ported program
        # would fail on it alone.
        kwargs.pop("experimental_run_tf_function", None)
        result = original(self, *args, **kwargs)
        try:
            given = signature.bind(self, *args, **kwargs).arguments
        except TypeError:
            given = {"optimizer": None}
        # A custom train_step's model compiled without an optimizer (keras-io's GAN) gets
        # compile()'s RMSprop, which nothing uses: not one that trains apart.
        default = None if "optimizer" in given else getattr(self, "optimizer", None)
        self.__dict__[_COMPILE_DEFAULT] = None if default is None else weakref.ref(default)
        after_compile(self, given.get("jit_compile", "auto"))
        return result

    owner.compile = compile
    _rate_check.install_fit_hook(distributed_optimizers)
    _failed_calls.install()  # after the fit hook: it frees what that hook's frames hold too
    _install_loss_scale_hook()
    _compile_hook_installed = True


def _install_loss_scale_hook() -> None:
    """Makes every ``LossScaleOptimizer`` around a wrapped optimizer communicate itself at
    its first ``apply``: ``LossScaleOptimizer(wrap(Adam()))`` in a custom loop (or around
    ``wrap(model.optimizer.inner_optimizer)``) would otherwise check each rank's own
    gradients for overflow, and a rank that skipped a step would pair its next gradients
    with the others' previous ones, silently."""
    cls = keras.optimizers.LossScaleOptimizer
    original = cls.apply

    @functools.wraps(original)
    @tf.autograph.experimental.do_not_convert
    def apply(self, *args, **kwargs):
        if _distribute_loss_scaling(self):
            return self.apply(*args, **kwargs)  # now the wrapped class's
        parts = _keras_private.sub_optimizers(self)
        if parts is not None and not is_wrapped(self):  # in a custom loop, too
            variables = kwargs.get("trainable_variables", args[1] if len(args) > 1 else None)
            if not parts and not self.built and variables is not None:
                parts = _built_parts(self, variables)  # as the original would build it
            _refuse_loss_scaling_of_wrapped_parts(parts, f"LossScaleOptimizer '{self.name}'")
        return original(self, *args, **kwargs)

    cls.apply = apply


def _distribute_loss_scaling(optimizer: Any) -> bool:
    """Where Keras or the user put a ``LossScaleOptimizer`` around a wrapped optimizer,
    makes the outer one communicate (returns True): its finiteness check must see averaged
    gradients, or ranks would disagree on which steps to skip. It takes the inner one's
    reduction and local variables; the inner one, seeing already-reduced gradients, passes
    them through and keeps the accumulation (the LossScaleOptimizer has none)."""
    inner = getattr(optimizer, "inner_optimizer", None)
    if not (isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
            and not is_wrapped(optimizer) and is_wrapped(inner)):
        return False
    state = dataclasses.replace(inner.__dict__[_STATE], base=type(optimizer), passes=Passes())
    _wrap_in_place(optimizer, state)
    return True


def after_compile(model: Any, requested_jit: Any) -> None:
    """Fixes up a model compiled with a wrapped optimizer (also after ``load_model`` wraps it)."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return
    _distribute_loss_scaling(optimizer)  # Keras adds one under mixed_float16
    if is_wrapped(optimizer):
        _xla.turn_off_model_jit(model, requested_jit)
    parts = _keras_private.sub_optimizers(optimizer)
    if is_wrapped(optimizer) or (parts is not None and (not parts or any(map(is_wrapped, parts)))):
        # A MultiOptimizer's sub-optimizers may be wrapped (given a function, it knows them
        # only once built).
        _build_before_first_step(model)
    # Every model: one whose train_step applies wrapped optimizers of its own (keras-io's
    # GAN compiles with none and keeps two as attributes) trains distributed too.
    _xla.turn_off_before_tracing(model, requested_jit,
                                 lambda: distributed_optimizers(model) is not None)
    _weight_check.install(model, functools.partial(_weight_check_settings, model))
    _warn_if_compiled_apart(model)


def _warn_if_compiled_apart(model: Any) -> None:
    """Warns once per model compiled with a wrapped optimizer before and with none now
    (keras-io's fine-tuning step, ``wrap()`` forgotten the second time): each rank of a job
    would then train alone, with exit 0. Not an error: a model may be compiled again to
    train on one rank on purpose (keras_ring's callbacks refuse it in ``fit``). It only
    reads which optimizers are wrapped, building and raising nothing: a MultiOptimizer is
    left to ``fit``'s checks (given a function, it knows its parts only once built)."""
    held = training_optimizers(model)
    multi = [_keras_private.sub_optimizers(o) for _, o in held]
    parts = [p for found in multi if found for p in found]
    if any(is_wrapped(o) or is_wrapped(getattr(o, "inner_optimizer", None))
           for o in [o for _, o in held] + parts):
        model.__dict__.setdefault(_COMPILED_WRAPPED, True)
        return
    if (not held or any(found is not None for found in multi)
            or model.__dict__.get(_COMPILED_WRAPPED) is not True
            or not RUNTIME.initialized or RUNTIME.topology().size < 2
            or not _keras_private.keras_train_step(model)):
        return
    model.__dict__[_COMPILED_WRAPPED] = "warned"
    described = ", ".join(f"{name}: {type(o).__name__}" for name, o in held)
    warnings.warn(
        f"keras_ring: model '{model.name}' was compiled with a keras_ring.wrap() optimizer "
        f"before and now with {described}, which keras_ring does not wrap: "
        f"each of the {RUNTIME.topology().size} ranks will train alone. Compile with "
        "keras_ring.wrap(optimizer) to go on training together", UserWarning, stacklevel=4)


def distributed_optimizers(model: Any) -> tuple[list[Any], ProcessSet] | None:
    """The wrapped optimizers that train the model now, and the ranks they average over:
    its compiled one and those it holds as attributes (keras-io's GAN). None: there are
    none (a model compiled again without keras_ring trains alone on each rank), or they
    average over different process sets (no one set of ranks must agree)."""
    optimizers = _trained_optimizers(model)
    sets = [o.__dict__[_STATE].options.process_set for o in optimizers]
    if not sets or any(s != sets[0] for s in sets):
        return None
    return optimizers, sets[0]


def _trained_optimizers(model: Any) -> list[Any]:
    """The wrapped optimizers among the compiled one (unless compile() chose it, unasked) and
    those ``model`` holds as attributes (``d_optimizer``, ``g_optimizer``). Where some are
    wrapped and others not, the variables those update would train apart on each rank,
    silently: a ValueError naming them."""
    wrapped, plain = _optimizers_of(model)
    if wrapped and plain:
        raise ValueError(
            f"keras_ring: {type(model).__name__} holds optimizers wrapped with keras_ring.wrap "
            f"({', '.join(name for name, _ in wrapped)}) and optimizers that are not "
            f"({', '.join(f'{name}: {type(o).__name__}' for name, o in plain)}): what those "
            "update would train apart on each rank. Wrap them too (keras_ring.wrap), or use "
            "keras_ring.PartialDistributedOptimizer for variables meant to stay per rank"
            + ("; if train_step never uses compile()'s optimizer, compile without one"
               if any(name == "optimizer" for name, _ in plain) else ""))
    return [value for _, value in wrapped]


def training_optimizers(model: Any) -> list[tuple[str, Any]]:
    """(name, optimizer) of the compiled one ("optimizer"), unless compile() chose it,
    unasked (the RMSprop a GAN's ``super().compile()`` gets and never applies), then those
    ``model`` holds as attributes (keras-io's GAN: ``d_optimizer``, ``g_optimizer``), in the
    model's order, the same on every rank."""
    held = _keras_private.held_optimizers(model)
    compiled = getattr(model, "optimizer", None)
    default = model.__dict__.get(_COMPILE_DEFAULT)
    if compiled is not None and (default is None or default() is not compiled):
        held.insert(0, ("optimizer", compiled))
    return held


def _optimizers_of(model: Any) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
    """``training_optimizers(model)``: the wrapped ones, and the others. A LossScaleOptimizer
    around a wrapped one (wrapped after compile) is made to communicate first, so it counts
    as wrapped."""
    held = training_optimizers(model)
    for _, value in held:
        _distribute_loss_scaling(value)
    held = [part for name, value in held for part in _parts(model, name, value)]
    wrapped = [(name, value) for name, value in held if is_wrapped(value)]
    return wrapped, [(name, value) for name, value in held if not is_wrapped(value)]


def _parts(model: Any, name: str, optimizer: Any) -> list[tuple[str, Any]]:
    """A ``MultiOptimizer`` that keras_ring does not wrap trains through its sub-optimizers,
    which may be wrapped (``MultiOptimizer(select, ...)`` of ``wrap(Adam())`` and
    ``wrap(SGD())``): they stand in its place. One given a function knows them only once
    built: the compiled one that Keras's own ``train_step`` applies is built here once the
    model is (on the model's trainable variables, as Keras's first step would build it);
    any other is built by the program, for the variables it chooses, and until then stands
    for nothing, neither wrapped nor plain (the checks that run later see its parts)."""
    parts = None if is_wrapped(optimizer) else _keras_private.sub_optimizers(optimizer)
    if parts is None:
        return [(name, optimizer)]
    if (not parts and not optimizer.built and name == "optimizer"
            and _keras_private.keras_train_step(model) and model.trainable_variables
            and not _keras_private.unbuilt_layers(model)):
        parts = _built_parts(optimizer, model.trainable_variables)
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        _refuse_loss_scaling_of_wrapped_parts(parts, f"{type(model).__name__}'s {name}")
    return [(f"{name}.optimizers[{i}]", part) for i, part in enumerate(parts)]


def _built_parts(optimizer: Any, variables: Any) -> list:
    """The sub-optimizers of a ``MultiOptimizer`` given a function, which it makes only when
    built: builds it on ``variables`` first."""
    optimizer.build(list(variables))
    return _keras_private.sub_optimizers(optimizer) or []


def _refuse_loss_scaling_of_wrapped_parts(parts: list, where: str) -> None:
    """A LossScaleOptimizer around a MultiOptimizer of wrapped optimizers would check each
    rank's own gradients: ranks would skip different steps, and their sub-optimizers'
    collectives would pair across steps."""
    if any(is_wrapped(p) for p in parts):
        raise ValueError(
            f"keras_ring: {where} is a LossScaleOptimizer (Keras adds one under the "
            "mixed_float16 policy) around a MultiOptimizer of wrapped optimizers: each rank "
            "would decide alone which steps overflow and skip them, and the ranks would part. "
            "Wrap the MultiOptimizer instead of its sub-optimizers: "
            "keras_ring.wrap(keras.optimizers.MultiOptimizer(...)) communicates before the "
            "loss-scale check")


def unwrapped_training(model: Any) -> str | None:
    """Where ``fit`` would train ``model`` on each rank alone, with no gradient averaged:
    Keras's own ``train_step`` applies compile()'s optimizer, and no optimizer of the model
    is wrapped (``wrap()`` forgotten). Its optimizers, described; else None. A custom
    ``train_step`` may average through a ``DistributedGradientTape``: never said of it."""
    if not _keras_private.keras_train_step(model):
        return None
    return unwrapped_optimizers(model)


def refuse_training_apart(model: Any, who: str, process_set: ProcessSet) -> None:
    """Raises where ``fit`` would train each rank of ``process_set`` alone
    (:func:`unwrapped_training`) under a keras_ring callback ``who``, which only makes sense
    for ranks that train together: a model compiled again without ``wrap()`` (keras-io's
    fine-tuning step) under ``MetricAverageCallback`` trained apart silently, its averaged
    metrics looking as usual."""
    plain = unwrapped_training(model) if len(process_set.members()) > 1 else None
    if plain is not None:
        raise ValueError(
            f"{who}: model '{model.name}' trains with optimizers that keras_ring does not "
            f"wrap ({plain}): each rank would apply its own gradients and the ranks would "
            "train apart. Compile with keras_ring.wrap(optimizer) (Horovod's "
            "DistributedOptimizer), also when compiling the model again, say to fine-tune it")


def unwrapped_optimizers(model: Any) -> str | None:
    """The optimizers of ``model`` (compiled, or held as attributes), described, where it has
    some and keras_ring wraps none of them; else None."""
    wrapped, plain = _optimizers_of(model)
    if wrapped or not plain:
        return None
    return ", ".join(f"{name}: {type(o).__name__}" for name, o in plain)


def _weight_check_settings(model: Any) -> tuple[set[int], ProcessSet] | None:
    """What ``_weight_check`` leaves out (local variables) and where it compares."""
    found = distributed_optimizers(model)
    if found is None:
        return None
    local: set[int] = set()
    for optimizer in found[0]:
        local |= optimizer.__dict__[_STATE].local.keys()
    return local, found[1]


def _build_before_first_step(model: Any) -> None:
    """Makes ``fit``/``train_on_batch`` build a lazily built model before its first step.

    Keras 3 on TensorFlow (without a distribution strategy) builds a model that has no
    ``Input`` only while tracing the first train step, i.e. after the callbacks' last chance
    to broadcast the root's initial weights: that step would run on unsynchronised weights.
    Keras's other backends, and TensorFlow under a strategy, build symbolically from the
    first batch before the first step; a model compiled with a wrapped optimizer does that
    too, so its variables (and the optimizer's) exist when the broadcast runs.
    """
    if not _keras_private.has_symbolic_build(model):
        return  # another Keras: it keeps its own build path
    original = model._maybe_symbolic_build

    def maybe_symbolic_build(iterator=None, data_batch=None):
        if (not _keras_private.unbuilt_layers(model) or not _keras_private.has_call(model)
                or getattr(model, "_distribute_strategy", None) is not None):
            return original(iterator=iterator, data_batch=data_batch)
        if data_batch is None and iterator is not None:
            data_batch = _keras_private.first_batch(iterator)
        model._symbolic_build(data_batch=data_batch)

    model._maybe_symbolic_build = maybe_symbolic_build
