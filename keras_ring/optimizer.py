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
import threading
from dataclasses import dataclass
from typing import Any

import keras
import tensorflow as tf

from keras_ring import _keras_private, _lifecycle, _step_check
from keras_ring._accumulation import Passes
from keras_ring._buckets import DEFAULT_BUCKET_BYTES, DEFAULT_FIRST_BUCKET_BYTES, ReduceOptions, map_gradient
from keras_ring._local import (LocalSources, check_local_layers, check_scale, check_variable,
                               reduce_partially)
from keras_ring._overwrite import combine_passes, overwrites
from keras_ring.collectives import Average, ReduceOp
from keras_ring.compression import Compression, Compressor
from keras_ring.process_sets import ProcessSet, global_process_set

_STATE = "_keras_ring_state"
_CLASSES: dict[type, type] = {}
# Set while a wrapped optimizer applies gradients it has already reduced, so that a wrapped
# optimizer inside it (a LossScaleOptimizer's inner one) does not reduce them a second time.
_reduced = threading.local()


@dataclass(frozen=True)
class _WrapState:
    base: type  # the optimizer's original class
    options: ReduceOptions
    passes: Passes  # backward_passes_per_step, average_aggregated_gradients
    local: LocalSources  # variables whose gradients stay on this rank (mutable)


def wrap(
    optimizer: keras.optimizers.Optimizer | str,
    *positional: Any,
    op: ReduceOp = Average,
    compression: Compressor | Any = Compression.none,
    bucket_bytes: int | str | None = DEFAULT_BUCKET_BYTES,
    first_bucket_bytes: int | str | None = DEFAULT_FIRST_BUCKET_BYTES,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    scale_local_gradients: bool = True,
    process_set: ProcessSet = global_process_set,
    groups: int | list[list[Any]] | None = None,
    num_groups: int = 0,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
) -> keras.optimizers.Optimizer:
    """Makes ``optimizer`` average (or sum) its gradients over all ranks before each update.

    The optimizer object itself is turned into the distributed one and returned: it becomes
    an instance of a subclass of its own class that overrides only ``apply``, and keeps its
    state (variables, learning rate, iteration count). Its ``get_config`` is unchanged and
    its ``__class__`` reports the original class, so ``model.save()`` writes the plain
    optimizer and ``keras.models.load_model`` loads it without keras_ring.

    Gradients are allreduced in buckets of about ``bucket_bytes``, in reverse variable order
    (the order backprop produces them), one grouped collective per bucket, each starting as
    soon as its own gradients exist, while backprop continues. ``None``
    gradients are skipped. With ``gradient_accumulation_steps`` the ranks communicate once
    per optimizer update, not per micro-batch. ``Model.compile`` turns XLA off for a
    wrapped optimizer (the collectives have no XLA kernel), and under the ``mixed_float16``
    policy it moves the communication to the ``LossScaleOptimizer`` that Keras adds, so the
    finiteness check sees the averaged gradients and every rank skips the same steps. A
    ``LossScaleOptimizer`` around a wrapped optimizer (``LossScaleOptimizer(wrap(Adam()))``
    in a custom loop) takes the communication over the same way at its first ``apply``;
    ``wrap(LossScaleOptimizer(Adam()))`` says so at once. A wrapped optimizer inside a
    wrapped one does not communicate again.

    Args:
        optimizer: a ``keras.optimizers.Optimizer`` (a ``LossScaleOptimizer`` too), or a
            name such as ``"adam"``.
        op: ``keras_ring.Average`` (the default) or ``keras_ring.Sum``.
        compression: a ``keras_ring.Compression`` member (the dtype gradients travel in), or
            a compressor in Horovod's shape: ``compress(tensor) -> (tensor, ctx)`` and
            ``decompress(tensor, ctx) -> tensor``.
        bucket_bytes: the size of one fused collective in bytes (of the wire dtype).
            ``"auto"`` (the default): ``KERAS_RING_BUCKET_BYTES`` if set, else chosen from
            a short measurement before the first reduction, the same on every rank: a
            power of two from 1 to 64 MiB, or 32 MiB without a first bucket where the ranks
            leave no core free for communication during backprop (CPU training with every
            core busy, where overlap measured slower). ``None`` sends all dense gradients
            in one collective.
        first_bucket_bytes: the limit of the first bucket (the last layers' gradients,
            which backprop computes first), so that communication starts early in
            backprop. ``"auto"`` (the default): what the measurement chose if it chose
            ``bucket_bytes``, else 1 MiB. ``None``: as large as the others.
        sparse_as_dense: if True, ``tf.IndexedSlices`` gradients (e.g. from ``Embedding``)
            are densified and allreduced; by default their values and indices are
            allgathered, which moves less data when few rows are touched.
        gradient_predivide_factor: with ``op=Average``, gradients are divided by this
            factor before the sum and multiplied by ``factor / size()`` after it, which
            keeps float16 sums in range.
        backward_passes_per_step: backward passes (``apply`` calls) per update. Above 1,
            each rank adds up the passes' gradients locally (Keras's
            ``gradient_accumulation_steps``, set to this value) and the ranks communicate
            once, on the pass that updates; the others apply nothing. The optimizer must
            not be built yet.
        average_aggregated_gradients: with ``backward_passes_per_step > 1``, update with
            the sum of the passes' gradients divided by their number; by default (as in
            Horovod) with their sum.
        scale_local_gradients: divide the gradients of local variables (see
            :func:`PartialDistributedOptimizer` and ``register_local_var``) by ``size()``,
            as Horovod does. Default True.
        process_set: the ranks that average the gradients (``keras_ring.ProcessSet``, e.g.
            the data-parallel group of one pipeline stage); all by default. Only its ranks
            may train with this optimizer.
        groups: Horovod's explicit fusion, in place of buckets: an int N splits the dense
            gradients into N collectives of consecutive variables, as equal in count as
            possible; a list of lists of variables sends each list's gradients in one
            collective and every other gradient alone. Only how gradients travel changes,
            not the result. Not together with ``bucket_bytes``/``first_bucket_bytes``.
        num_groups: Horovod's older spelling of ``groups=N``; 0 (the default) for none;
            ignored, with a warning, where ``groups`` is given.
        name: the start of the collectives' names (in the timeline and in mismatch
            errors); ``"gradients"`` where None or empty.
        device_dense, device_sparse: accepted for Horovod programs and ignored: the
            collectives run where the gradients are.

    Returns:
        ``optimizer`` itself, now distributed.

    Raises:
        ValueError: ``op`` is not Sum or Average, an option is out of range, the
            optimizer is already wrapped, or accumulation cannot be set up on it.
        TypeError: ``optimizer`` is not a Keras 3 optimizer, or an option has the wrong type.

    Example:

    ```python
    keras_ring.init()
    optimizer = keras_ring.wrap(keras.optimizers.Adam(1e-3 * keras_ring.size()))
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    ```
    """
    who = "keras_ring.wrap"
    if positional:
        # Horovod's APIs order them differently (name second in its Keras one, use_locking
        # third in its TensorFlow one): a value by position could land in the wrong option.
        raise TypeError(
            f"{who} (also keras_ring.DistributedOptimizer) takes the optimizer by position "
            f"and its options by keyword; got {len(positional)} more positional "
            f"argument(s) ({', '.join(repr(a)[:40] for a in positional)}): name them, e.g. "
            "DistributedOptimizer(optimizer, name='...', compression=...)")
    del device_dense, device_sparse
    options = ReduceOptions.create(who, op, compression, bucket_bytes, sparse_as_dense,
                                   gradient_predivide_factor, process_set, first_bucket_bytes,
                                   groups=groups, num_groups=num_groups, name=name)
    passes = Passes.create(who, backward_passes_per_step, average_aggregated_gradients)
    local = LocalSources(scale=check_scale(scale_local_gradients, who))
    optimizer = _as_optimizer(optimizer)
    _accumulate_passes(optimizer, passes, who)
    if getattr(optimizer, "gradient_accumulation_steps", None):
        _keras_private.check_accumulation(optimizer)
    _wrap_in_place(optimizer, _WrapState(type(optimizer), options, passes, local))
    for step in _lifecycle.AFTER_WRAP:  # Model.compile's hook (keras_ring._model_optimizers)
        step()
    return optimizer


# Horovod's name for the same thing, so that migrating is an import swap.
DistributedOptimizer = wrap


def PartialDistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer: keras.optimizers.Optimizer | str,
    *,
    local_layers: keras.layers.Layer | list[keras.layers.Layer] | None = None,
    **options: Any,
) -> keras.optimizers.Optimizer:
    """:func:`wrap`, except that the gradients of ``local_layers`` are not reduced.

    Each rank updates those layers' trainable weights with its own gradients (divided by
    ``size()`` unless ``scale_local_gradients=False``), so they may differ between ranks:
    e.g. a per-rank head, or embeddings sharded by hand. The layers' weights are looked up
    at every update, so a layer built later (a model without an ``Input``) counts too.

    Args:
        optimizer: as for :func:`wrap`.
        local_layers: a ``keras.layers.Layer`` or a list of them, or None (then this is
            :func:`wrap`).
        **options: :func:`wrap`'s keyword arguments.

    Returns:
        ``optimizer`` itself, now distributed.

    Example:

    ```python
    head = keras.layers.Dense(10)
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64), head])
    optimizer = keras_ring.PartialDistributedOptimizer(keras.optimizers.SGD(0.1),
                                                       local_layers=[head])
    ```
    """
    layers = check_local_layers(local_layers, "keras_ring.PartialDistributedOptimizer")
    optimizer = wrap(optimizer, **options)
    optimizer.__dict__[_STATE].local.layers.extend(layers)
    return optimizer


def _register_local_var(self, var: Any) -> None:
    """Keeps ``var``'s gradient on this rank: it is not reduced (Horovod's method)."""
    self.__dict__[_STATE].local.register(check_variable(var, "register_local_var"))


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
            "register_local_var": _register_local_var,
            # Serialization (and anything else) that asks for __class__ sees the plain
            # optimizer class, so saved models carry no trace of keras_ring.
            # type(optimizer) is still this subclass, and isinstance works either way.
            "__class__": property(lambda self: base),
        })
        _CLASSES[base] = cls
    return cls


# The descriptor behind `obj.__class__ = X`, bypassing the property above.
_set_class = object.__dict__["__class__"].__set__


def _wrap_in_place(optimizer: keras.optimizers.Optimizer, state: _WrapState) -> None:
    setattr(optimizer, _STATE, state)
    _set_class(optimizer, _distributed_class(state.base))


def _accumulate_passes(optimizer: keras.optimizers.Optimizer, passes: Passes, who: str) -> None:
    """Turns Keras's gradient accumulation on for ``backward_passes_per_step``."""
    if passes.steps == 1:
        return
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise ValueError(f"{who}: backward_passes_per_step={passes.steps} with a "
                         "LossScaleOptimizer: wrap its inner optimizer instead (Keras adds the "
                         "LossScaleOptimizer itself under the mixed_float16 policy)")
    current = optimizer.gradient_accumulation_steps
    if current == passes.steps:
        return
    if current:
        raise ValueError(f"{who}: backward_passes_per_step={passes.steps}, but the optimizer "
                         f"has gradient_accumulation_steps={current}; set only one of them")
    if optimizer.built:
        raise ValueError(f"{who}: backward_passes_per_step={passes.steps} needs an optimizer "
                         f"that is not built yet (its {type(optimizer).__name__} already has its "
                         "variables, and accumulation needs its own); wrap it before the first "
                         "step or optimizer.build()")
    optimizer.gradient_accumulation_steps = passes.steps


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
        grads = _communicate(self, state, grads, trainable_variables)
    elif grads and state.passes.sum_factor != 1:
        # An outer wrapped LossScaleOptimizer reduced every pass; Keras will average the
        # passes we accumulate, and backward_passes_per_step asks for their sum (of
        # gradients: a new value is no sum).
        variables = _variables(self, trainable_variables) or [None] * len(grads)
        grads = [g if overwrites(v) else map_gradient(g, lambda x: x * state.passes.sum_factor)
                 for g, v in zip(grads, variables)]
    # Tracing is synchronous, so this also holds while tf.function traces the inner apply.
    with _already_reduced():
        return state.base.apply(self, grads, trainable_variables)


def _communicate(optimizer, state: _WrapState, grads: list, variables) -> list:
    scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    _check_global_clipnorm(optimizer, state)

    def reduce(grads: list, variables: list | None, suffix: str = "") -> list:
        return reduce_partially(grads, variables, state.options, state.local,
                                state.options.name + suffix, overflow_everywhere=scaled)

    # A LossScaleOptimizer has no accumulation of its own (its inner one may: then the
    # averaged gradients are accumulated, which costs one allreduce per micro-batch but
    # keeps every rank's skip-on-overflow decision the same).
    steps = None
    if not scaled:
        steps = optimizer.gradient_accumulation_steps
    checks = _step_check.before_reduce(  # a custom step's (fit has its own, between steps)
        _variables(optimizer, variables), state.local.keys(), state.options.process_set,
        steps or 1, f"in the apply of wrapped optimizer '{optimizer.name}'",
        "PartialDistributedOptimizer")
    with tf.control_dependencies(checks):
        if not steps:
            return reduce(grads, _variables(optimizer, variables))
        return _reduce_once_per_update(optimizer, reduce, grads, variables, steps,
                                       state.passes.sum_factor)


def _check_global_clipnorm(optimizer, state: _WrapState) -> None:
    clipping = getattr(getattr(optimizer, "inner_optimizer", optimizer), "global_clipnorm", None)
    if clipping and state.local.keys():
        raise ValueError(
            f"keras_ring: optimizer '{optimizer.name}' has global_clipnorm={clipping} and local "
            "gradients (PartialDistributedOptimizer, register_local_var): the norm would include "
            "each rank's own local gradients, so every rank would scale the shared, reduced "
            "gradients differently and the ranks' shared weights would drift apart. Use "
            "clipnorm (per variable) or clipvalue instead")


def _variables(optimizer, variables) -> list | None:
    """The variables ``apply`` updates, in the order of the gradients (None if unknown yet)."""
    if variables is not None:
        return list(variables)
    return _keras_private.built_variables(optimizer) if optimizer.built else None


def _reduce_once_per_update(optimizer, reduce, grads: list, variables, steps: int,
                            factor: int = 1) -> list:
    """With gradient accumulation: communicate only on the micro-batch that updates.

    Keras accumulates locally and on the update step applies ``(g + acc) / steps``. On that
    step we empty ``acc`` and hand it ``g' = factor * allreduce(g + acc)`` instead of ``g``, so
    it applies the ranks' average of the accumulated sums times ``factor / steps`` (``factor`` is
    ``steps`` for Horovod's ``backward_passes_per_step``, which applies the sum), and on
    other steps the local ``g`` unchanged. Every rank counts the same iterations, so all
    take the same branch. This reads the accumulators Keras keeps
    (``_accumulated_gradients``); Keras has no public accessor. ``reduce(grads, variables,
    name_suffix)`` is the reduction.
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

    # Keras keeps the largest of the passes' new values for variables it overwrites (float8
    # scales), unscaled, and the sum of the others' gradients.
    new = [overwrites(variables[i]) for i in live]

    def update():
        totals = reduce([combine_passes(n, g, tf.cast(tf.convert_to_tensor(a), g.dtype)
                                        * (1.0 if n else scale))
                         for n, g, a in zip(new, dense, accumulators)],
                        [variables[i] for i in live], ".accumulated")
        # Keras adds its accumulators back (or takes the maximum with them): emptied here (it
        # resets them after the update anyway), they change nothing, so every rank applies
        # exactly the reduced totals. Returning t - acc instead left ulps of each rank's own
        # acc in the weights.
        with tf.control_dependencies(totals):
            emptied = [a.assign(tf.zeros_like(a)) for a in accumulators]
        with tf.control_dependencies([e for e in emptied if e is not None]):
            return [tf.identity(t * factor if factor != 1 and not n else t)
                    for n, t in zip(new, totals)]

    micro_batch = tf.convert_to_tensor(_keras_private.raw_iterations(optimizer))
    is_update = tf.equal(tf.math.floormod(micro_batch + 1, steps), 0)
    reduced = tf.cond(is_update, update, lambda: dense)
    out = list(grads)
    for i, r in zip(live, reduced):
        out[i] = r
    return out
