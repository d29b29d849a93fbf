"""``keras_ring.wrap``: a Keras 3 optimizer that averages gradients over the ranks.

The wrapped optimizer is the same object, re-classed to a subclass of its own class that
overrides one public method, ``apply(grads, trainable_variables)``: it allreduces the
gradients, then runs the original ``apply``. Everything else (variables, ``get_config``,
clipping, weight decay, EMA, saving) is the inner optimizer's own code, and ``__class__``
reports the original class, so ``model.save()`` writes exactly what the unwrapped optimizer
would write and a process that never imports keras_ring loads it as e.g. ``Adam``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from dataclasses import dataclass
from typing import Any

import keras
import tensorflow as tf

from keras_ring import _keras_private, _xla
from keras_ring._buckets import DEFAULT_BUCKET_BYTES, ReduceOptions, reduce_gradients
from keras_ring.collectives import Average, ReduceOp
from keras_ring.compression import Compression, Compressor

_STATE = "_keras_ring_state"
_CLASSES: dict[type, type] = {}
_compile_hook_installed = False
# Set while a wrapped optimizer applies gradients it has already reduced, so that a wrapped
# optimizer inside it (a LossScaleOptimizer's inner one) does not reduce them a second time.
_reduced = threading.local()


@dataclass(frozen=True)
class _WrapState:
    base: type  # the optimizer's original class
    options: ReduceOptions


def wrap(
    optimizer: keras.optimizers.Optimizer | str,
    *,
    op: ReduceOp = Average,
    compression: Compressor = Compression.none,
    bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
) -> keras.optimizers.Optimizer:
    """Makes ``optimizer`` average (or sum) its gradients over all ranks before each update.

    The optimizer object itself is turned into the distributed one and returned: it becomes
    an instance of a subclass of its own class that overrides only ``apply``, and keeps its
    state (variables, learning rate, iteration count). Its ``get_config`` is unchanged and
    its ``__class__`` reports the original class, so ``model.save()`` writes the plain
    optimizer and ``keras.models.load_model`` loads it without keras_ring.

    Gradients are allreduced in buckets of about ``bucket_bytes``, in reverse variable order
    (the order backprop produces them), one grouped collective per bucket. ``None``
    gradients are skipped. With ``gradient_accumulation_steps`` the ranks communicate once
    per optimizer update, not per micro-batch. ``Model.compile`` turns XLA off for a
    wrapped optimizer (the collectives have no XLA kernel), and under the ``mixed_float16``
    policy it moves the communication to the ``LossScaleOptimizer`` that Keras adds, so the
    finiteness check sees the averaged gradients and every rank skips the same steps. In a
    custom loop with loss scaling, wrap the ``LossScaleOptimizer`` itself:
    ``wrap(LossScaleOptimizer(Adam()))``; a wrapped optimizer inside a wrapped one does not
    communicate again.

    Args:
        optimizer: a ``keras.optimizers.Optimizer`` (a ``LossScaleOptimizer`` too), or a
            name such as ``"adam"``.
        op: ``keras_ring.Average`` (the default) or ``keras_ring.Sum``.
        compression: a ``keras_ring.Compression`` member: the dtype gradients travel in.
        bucket_bytes: the size of one fused collective in bytes (of the wire dtype);
            default 32 MiB. ``None`` sends all dense gradients in one collective.
        sparse_as_dense: if True, ``tf.IndexedSlices`` gradients (e.g. from ``Embedding``)
            are densified and allreduced; by default their values and indices are
            allgathered, which moves less data when few rows are touched.
        gradient_predivide_factor: with ``op=Average``, gradients are divided by this
            factor before the sum and multiplied by ``factor / size()`` after it, which
            keeps float16 sums in range.

    Returns:
        ``optimizer`` itself, now distributed.

    Raises:
        ValueError: ``op`` is not Sum or Average, an option is out of range, or the
            optimizer is already wrapped.
        TypeError: ``optimizer`` is not a Keras 3 optimizer.

    Example:

    ```python
    keras_ring.init()
    optimizer = keras_ring.wrap(keras.optimizers.Adam(1e-3 * keras_ring.size()))
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    ```
    """
    options = ReduceOptions.create("keras_ring.wrap", op, compression, bucket_bytes,
                                   sparse_as_dense, gradient_predivide_factor)
    optimizer = _as_optimizer(optimizer)
    if getattr(optimizer, "gradient_accumulation_steps", None):
        _keras_private.check_accumulation(optimizer)
    _wrap_in_place(optimizer, options)
    install_compile_hook()
    return optimizer


# Horovod's name for the same thing, so that migrating is an import swap.
DistributedOptimizer = wrap


def is_wrapped(optimizer: Any) -> bool:
    """True if ``optimizer`` was returned by :func:`wrap`."""
    return type(optimizer).__dict__.get("apply") is _apply and _STATE in vars(optimizer)


def _as_optimizer(optimizer: Any) -> keras.optimizers.Optimizer:
    if isinstance(optimizer, str):
        optimizer = keras.optimizers.get(optimizer)
    if isinstance(optimizer, type):
        raise TypeError("keras_ring.wrap takes an optimizer instance, got the class "
                        f"{optimizer.__name__}; call it first, e.g. {optimizer.__name__}()")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError("keras_ring.wrap takes a Keras 3 optimizer (keras.optimizers."
                        f"Optimizer), got {type(optimizer).__module__}."
                        f"{type(optimizer).__qualname__}")
    if is_wrapped(optimizer):
        raise ValueError(f"keras_ring.wrap: this {type(optimizer).__name__} is already "
                         "wrapped; wrap an optimizer once")
    return optimizer


def _distributed_class(base: type) -> type:
    """The subclass of ``base`` that wrapped optimizers of class ``base`` get (one per base)."""
    cls = _CLASSES.get(base)
    if cls is None:
        cls = type(base.__name__, (base,), {
            "__module__": __name__,
            "__qualname__": base.__qualname__,
            "__doc__": f"{base.__name__}, with gradients reduced over ranks by keras_ring.",
            "apply": _apply,
            # Serialization (and anything else) that asks for __class__ sees the plain
            # optimizer class, so saved models carry no trace of keras_ring.
            # type(optimizer) is still this subclass, and isinstance works either way.
            "__class__": property(lambda self: base),
        })
        _CLASSES[base] = cls
    return cls


# The descriptor behind `obj.__class__ = X`, bypassing the property above.
_set_class = object.__dict__["__class__"].__set__


def _wrap_in_place(optimizer: keras.optimizers.Optimizer, options: ReduceOptions) -> None:
    base = type(optimizer)
    setattr(optimizer, _STATE, _WrapState(base, options))
    _set_class(optimizer, _distributed_class(base))


@contextlib.contextmanager
def _already_reduced():
    depth = getattr(_reduced, "depth", 0)
    _reduced.depth = depth + 1
    try:
        yield
    finally:
        _reduced.depth = depth


@tf.autograph.experimental.do_not_convert
def _apply(self, grads, trainable_variables=None):
    """Allreduces ``grads`` over the ranks, then applies them with the optimizer's own apply."""
    state: _WrapState = self.__dict__[_STATE]
    grads = list(grads)
    if grads and not getattr(_reduced, "depth", 0):
        grads = _communicate(self, state.options, grads, trainable_variables)
    # Tracing is synchronous, so this also holds while tf.function traces the inner apply.
    with _already_reduced():
        return state.base.apply(self, grads, trainable_variables)


def _communicate(optimizer, options: ReduceOptions, grads: list, variables) -> list:
    # A LossScaleOptimizer has no accumulation of its own (its inner one may: then the
    # averaged gradients are accumulated, which costs one allreduce per micro-batch but
    # keeps every rank's skip-on-overflow decision the same).
    steps = None
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        steps = optimizer.gradient_accumulation_steps
    if not steps:
        return reduce_gradients(grads, options)
    return _reduce_once_per_update(optimizer, options, grads, variables, steps)


def _reduce_once_per_update(optimizer, options: ReduceOptions, grads: list, variables,
                            steps: int) -> list:
    """With gradient accumulation: communicate only on the micro-batch that updates.

    Keras accumulates locally and on the update step applies ``(g + acc) / steps``. On that
    step we hand it ``g' = allreduce(g + acc) - acc`` instead of ``g``, so it applies the
    ranks' average of the accumulated sums, and on other steps the local ``g`` unchanged.
    Every rank counts the same iterations, so all take the same branch. This reads the
    accumulators Keras keeps (``_accumulated_gradients``); Keras has no public accessor.
    """
    if variables is None:
        if not optimizer.built:
            return grads  # Keras's apply raises its own clear error for this.
        variables = _keras_private.built_variables(optimizer)
    else:
        variables = list(variables)
        if not optimizer.built:
            with keras.name_scope(optimizer.name, caller=optimizer):
                optimizer.build(variables)
    live = [i for i, g in enumerate(grads) if g is not None]
    if not live:
        return grads
    # Keras divides the gradients by a static loss_scale_factor after us; acc is unscaled.
    scale = optimizer.loss_scale_factor or 1.0
    dense = [tf.convert_to_tensor(grads[i]) for i in live]
    accumulators = _keras_private.accumulators(optimizer, [variables[i] for i in live])

    def scaled_accumulators():
        return [tf.cast(tf.convert_to_tensor(a), g.dtype) * scale for a, g in zip(accumulators, dense)]

    def update():
        acc = scaled_accumulators()
        totals = reduce_gradients([g + a for g, a in zip(dense, acc)], options,
                                  name="gradients.accumulated")
        return [t - a for t, a in zip(totals, acc)]

    micro_batch = tf.convert_to_tensor(_keras_private.raw_iterations(optimizer))
    is_update = tf.equal(tf.math.floormod(micro_batch + 1, steps), 0)
    reduced = tf.cond(is_update, update, lambda: dense)
    out = list(grads)
    for i, r in zip(live, reduced):
        out[i] = r
    return out


# --- Model.compile integration -----------------------------------------------------------

def install_compile_hook() -> None:
    """Wraps ``keras.Model.compile`` once, to fix up models compiled with wrapped optimizers."""
    global _compile_hook_installed
    if _compile_hook_installed:
        return
    original = keras.Model.compile
    signature = inspect.signature(original)

    @functools.wraps(original)
    def compile(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        try:
            requested = signature.bind(self, *args, **kwargs).arguments.get("jit_compile", "auto")
        except TypeError:
            requested = "auto"
        _after_compile(self, requested)
        return result

    keras.Model.compile = compile
    _compile_hook_installed = True


def _after_compile(model: Any, requested_jit: Any) -> None:
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return
    inner = getattr(optimizer, "inner_optimizer", None)
    if (isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
            and not is_wrapped(optimizer) and is_wrapped(inner)):
        # Keras put a LossScaleOptimizer around ours (mixed_float16). Its finiteness check
        # must see averaged gradients, or ranks would disagree on which steps to skip and
        # only some would enter the collectives: communicate in the outer one (the inner
        # one then sees already-reduced gradients and passes them through).
        _wrap_in_place(optimizer, inner.__dict__[_STATE].options)
    if is_wrapped(optimizer):
        _xla.turn_off_model_jit(model, requested_jit)
        _build_before_first_step(model)


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
        if (not _keras_private.unbuilt_layers(model)
                or getattr(model, "_distribute_strategy", None) is not None):
            return original(iterator=iterator, data_batch=data_batch)
        if data_batch is None and iterator is not None:
            data_batch = _keras_private.first_batch(iterator)
        model._symbolic_build(data_batch=data_batch)

    model._maybe_symbolic_build = maybe_symbolic_build
