"""Collective operations on tensors and Python objects.

Every function works eagerly and inside ``tf.function``; results are bitwise identical on
every rank. Invalid arguments raise before anything is communicated.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from keras_ring import _keras_private, errors
from keras_ring.ops import wrappers
from keras_ring.ops.reduce_op import ReduceOp
from keras_ring.process_sets import (ROOT_NOT_IN_SET, ProcessSet, global_process_set, resolve,
                                     root_in_set, set_rank, set_size)
from keras_ring.runtime import RUNTIME

wrappers.register_gradients(set_rank, set_size)

Sum = ReduceOp.Sum
Average = ReduceOp.Average
Min = ReduceOp.Min
Max = ReduceOp.Max
Product = ReduceOp.Product


class _DtypeSet(tuple):
    """Dtypes in the order errors name them, tested for membership by identity first:
    TensorFlow interns its DTypes, and a set of them calls the Python ``DType.__hash__`` (a
    tuple the Python ``__eq__`` element by element) on every eager call."""

    def __new__(cls, dtypes):
        self = super().__new__(cls, dtypes)
        self._members = frozenset(dtypes)
        self._ids = frozenset(id(d) for d in self._members)  # kept alive by _members
        return self

    def __contains__(self, dtype) -> bool:
        return id(dtype) in self._ids or dtype in self._members


REDUCE_DTYPES = _DtypeSet((
    tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int8, tf.uint8, tf.int16, tf.uint16,
    tf.int32, tf.int64,
))
GATHER_DTYPES = _DtypeSet(REDUCE_DTYPES + (tf.bool,))


def _check_dtype(tensor: tf.Tensor, allowed: tuple, what: str) -> None:
    if tensor.dtype not in allowed:
        names = ", ".join(d.name for d in allowed)
        raise TypeError(f"keras_ring.{what} does not support dtype {tensor.dtype.name}; supported: {names}")


def _check_op(op: Any) -> ReduceOp:
    if type(op) is ReduceOp:
        return op
    raise ValueError(f"op must be one of keras_ring.Sum, Average, Min, Max, Product; "
                     f"got {op!r}{op_hint(op)}")


def op_hint(op: Any) -> str:
    """What an ``op`` that is not a ``ReduceOp`` member probably meant, for its error."""
    # Numbers are refused, not converted: Horovod numbers its ops differently (its 0 is
    # Average and 1 Sum, keras_ring's the reverse), so a number from a Horovod program would
    # silently reduce with another op.
    if isinstance(op, ReduceOp):  # an IntEnum, so before the numbers: a member refused here
        return (" (gradients are reduced with Sum or Average only: Min, Max and Product of "
                "the ranks' gradients are no gradient of the global batch's loss)")
    if isinstance(op, (int, np.integer)) and not isinstance(op, bool):
        return (" (a number: pass the op itself, such as keras_ring.Sum; Horovod numbers its "
                "ops differently, its 0 is Average and 1 Sum)")
    if isinstance(op, str) and op.capitalize() in ReduceOp.__members__:
        return f" (a string: pass keras_ring.{op.capitalize()})"
    if isinstance(op, str):
        return (" (a string: horovod.tensorflow.keras's allreduce takes the name second, "
                f"keras_ring's takes the op; pass name={op!r})")
    return ""


def _check_name(name: str | None) -> str:
    if name is None:
        return ""
    if not isinstance(name, str):
        raise TypeError(f"name must be a string or None, got {type(name).__name__}")
    return name


def _check_factor(value: Any, what: str) -> float:
    # A string would pass float() ("2" -> 2.0) and a bool is an int: both are caller bugs.
    if type(value) is not float and (
            isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating))):
        raise TypeError(f"{what} must be a number, got {type(value).__name__}: {value!r}")
    factor = float(value)
    if not math.isfinite(factor):
        raise ValueError(f"{what} must be finite, got {factor}")
    return factor


def _to_tensor(value: Any, what: str) -> tf.Tensor:
    if isinstance(value, tf.Tensor):  # already one (eager or symbolic): nothing to convert
        return value
    try:
        return tf.convert_to_tensor(value)
    except (TypeError, ValueError) as e:
        raise TypeError(f"keras_ring.{what} needs a tensor, got {type(value).__name__}: {e}") from None


def _tensor(value: Any, allowed: tuple, what: str) -> tf.Tensor:
    """``value`` as a tensor of a dtype in ``allowed``."""
    tensor = _to_tensor(value, what)
    _check_dtype(tensor, allowed, what)
    return tensor


def _tensors(values: Iterable[Any], allowed: tuple, what: str) -> list[tf.Tensor]:
    """``values`` as tensors of dtypes in ``allowed``: all converted, then all checked."""
    tensors = [_to_tensor(v, what) for v in values]
    for t in tensors:
        _check_dtype(t, allowed, what)
    return tensors


def _reduce_args(what: str, op: Any, name: str | None, prescale_factor: Any,
                 postscale_factor: Any, process_set: ProcessSet | None = None,
                 ) -> tuple[ReduceOp, str, float, float, int]:
    """The checked arguments every reduction takes, once the runtime (of ``process_set``,
    which this rank must belong to) is known to run; the last is the process set's id."""
    set_id = resolve(process_set, what)
    return (_check_op(op), _check_name(name), _check_factor(prescale_factor, "prescale_factor"),
            _check_factor(postscale_factor, "postscale_factor"), set_id)


def _check_root(root_rank: Any) -> int:
    if isinstance(root_rank, bool) or not isinstance(root_rank, (int, np.integer)):
        raise TypeError(f"root_rank must be an int, got {type(root_rank).__name__}")
    # The op attribute is an int32. A root beyond it is out of range like any other: clamp it
    # so the runtime's range check reports it on every rank alike, instead of TensorFlow
    # (or an OverflowError) failing on this rank alone and leaving the others waiting.
    # Not as low as ROOT_NOT_IN_SET, which stands for a root outside a process set.
    return max(ROOT_NOT_IN_SET + 1, min(int(root_rank), 2**31 - 1))


def _run(fn, *args):
    """Calls an op; in eager mode its errors become keras_ring's error classes."""
    try:
        return fn(*args)
    except tf.errors.OpError as e:
        translated = errors.translate(e)
        if translated is e:
            raise
        raise translated from None
    except RuntimeError as e:
        if errors.is_interrupt_clash(e):  # Ctrl-C while waiting: see there
            raise KeyboardInterrupt from None
        raise


def resolve_op(op: Any, average: bool | None, what: str) -> Any:
    """Horovod's deprecated ``average=`` argument, mapped to ``op`` (Average by default)."""
    if average is not None:
        if op is not None:
            raise ValueError(f"keras_ring.{what}: pass op or the older average, not both "
                             f"(got op={op!r}, average={average!r})")
        return Average if average else Sum
    if isinstance(op, bool):  # horovod.tensorflow's second positional argument is average
        return Average if op else Sum
    return Average if op is None else op


def check_compression(compression: Any, who: str) -> Any:
    """Returns ``compression`` if it has Horovod's compressor shape; a ``TypeError`` otherwise
    (a string such as ``"fp16"`` would fail only when first used)."""
    if not isinstance(compression, str) and all(
            callable(getattr(compression, method, None)) for method in ("compress", "decompress")):
        return compression
    raise TypeError(f"{who}: compression must be one of keras_ring.Compression.none, .fp16 or "
                    ".bf16, or a compressor with compress(tensor) -> (tensor, ctx) and "
                    f"decompress(tensor, ctx) -> tensor, got {compression!r}")


def compress(compression: Any, tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
    """``(wire tensor, ctx)`` from a compressor of Horovod's shape (``compress`` returns
    ``(tensor, ctx)``), or of the older one that returns the tensor (ctx: its dtype)."""
    if compression is None:
        return tensor, None
    compressed = compression.compress(tensor)
    return compressed if isinstance(compressed, tuple) else (compressed, tensor.dtype)


def decompress(compression: Any, tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
    return tensor if compression is None else compression.decompress(tensor, ctx)


# The public collectives are not converted by autograph (do_not_convert): else the first
# tf.function calling one converted them and all they call, seconds of tracing; they are
# written for graphs as they are.
@tf.autograph.experimental.do_not_convert
def allreduce(
    tensor: Any,
    op: ReduceOp | None = None,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    *,
    average: bool | None = None,
    compression: Any = None,
    device_dense: str = "",
    device_sparse: str = "",
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> tf.Tensor | tf.IndexedSlices:
    """Reduces ``tensor`` over all ranks and returns the result on every rank.

    Args:
        tensor: a tensor (or anything convertible) of a supported dtype. ``tf.IndexedSlices``
            are allgathered (values and indices) for ``Sum`` and ``Average``.
        op: ``Sum``, ``Average`` (the default), ``Min``, ``Max`` or ``Product``. Average of
            integers divides the sum exactly, truncating toward zero.
        name: a name shared by all ranks; it is checked across ranks and used in errors.
        prescale_factor: multiplies the input before the reduction.
        postscale_factor: multiplies the result after it.
        average: Horovod's older spelling of ``op`` (True: Average, False: Sum).
        compression: a compressor (``Compression.fp16``, or Horovod's shape) for a dense
            tensor on the wire; sparse ones are not compressed, as in Horovod.
        device_dense, device_sparse, ignore_name_scope: accepted for Horovod compatibility;
            TensorFlow's placement and the explicit ``name`` decide instead.
        process_set: the ranks that reduce (``keras_ring.ProcessSet``); all by default.

    Example:

    ```python
    mean_loss = keras_ring.allreduce(loss, op=keras_ring.Average, name="loss")
    ```
    """
    del device_dense, device_sparse, ignore_name_scope
    op, tensor_name, pre, post, set_id = _reduce_args(
        "allreduce", resolve_op(op, average, "allreduce"), name, prescale_factor,
        postscale_factor, process_set)
    # Checked before the sparse branch, which ignores compression, so that a wrong one fails
    # whatever the gradient's kind on this step.
    if compression is not None:
        check_compression(compression, "keras_ring.allreduce")
    if not isinstance(tensor, tf.Tensor) and isinstance(tensor, tf.IndexedSlices):
        return _allreduce_indexed_slices(tensor, op, tensor_name, pre, post, process_set)
    tensor = _tensor(tensor, REDUCE_DTYPES, "allreduce")
    wire, ctx = compress(compression, tensor)
    out = _run(wrappers.allreduce, wire, int(op), pre, post, tensor_name, set_id)
    return decompress(compression, out, ctx)


def _allreduce_indexed_slices(slices, op, name, prescale, postscale, process_set=None):
    if op not in (Sum, Average):
        raise ValueError(f"allreduce of IndexedSlices supports Sum and Average, got {op.name}")
    _check_dtype(slices.values, REDUCE_DTYPES, "allreduce")
    size = set_size(resolve(process_set, "allreduce"))
    values, indices = slices.values, slices.indices
    # Scaling integers truncates, so it must see each row's sum, as the dense allreduce does:
    # rows are combined before and after the gather; single contributions are never scaled.
    exact = values.dtype.is_integer and (
        prescale != 1.0 or postscale != 1.0 or (op == Average and size > 1))
    if exact:
        values, indices = _combine_rows(values, indices)
        values = _scale_integers(values, prescale)
    # The allgathers' signatures carry no op, factors or dense shape: their names do, so
    # that ranks which differ there fail on every rank instead of scaling differently.
    tag = _sparse_tag(op, prescale, postscale, slices.dense_shape)
    values = allgather(values, name=f"{name}.values {tag}", process_set=process_set)
    indices = allgather(indices, name=f"{name}.indices {tag}", process_set=process_set)
    if exact:
        values, indices = _combine_rows(values, indices)
        if op == Average and postscale == 1.0:
            values = tf.truncatediv(values, tf.cast(size, values.dtype))
        else:  # one truncation, as the dense allreduce scales
            values = _scale_integers(values, postscale / (size if op == Average else 1))
    else:
        scale = prescale * postscale / (size if op == Average else 1)
        if scale != 1.0:
            values = values * tf.constant(scale, values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def _sparse_tag(op: ReduceOp, prescale: float, postscale: float, dense_shape: Any) -> str:
    shape = None if dense_shape is None else tf.get_static_value(dense_shape)
    shown = "?" if shape is None else "x".join(str(int(d)) for d in np.ravel(shape))
    return f"[{op.name} pre={prescale!r} post={postscale!r} dense_shape={shown}]"


def _combine_rows(values: tf.Tensor, indices: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """One row per distinct index, the sum of that index's rows (integers wrap)."""
    unique, position = tf.unique(indices)
    return tf.math.unsorted_segment_sum(values, position, tf.shape(unique)[0]), unique


def _scale_integers(values: tf.Tensor, factor: float) -> tf.Tensor:
    """``values * factor`` as the C++ kernels scale integers: truncated toward zero,
    saturated at the dtype's limits."""
    if factor == 1.0:
        return values
    dtype = values.dtype
    scaled = tf.cast(values, tf.float64) * factor
    scaled = tf.where(scaled < 0, tf.math.ceil(scaled), tf.math.floor(scaled))
    # float64 rounds int64's maximum up to 2**63, which no int64 holds: select, never cast it.
    low, high = float(dtype.min), float(dtype.max)
    inside = tf.cast(tf.clip_by_value(scaled, low, high), dtype)
    return tf.where(scaled >= high, tf.constant(dtype.max, dtype),
                    tf.where(scaled <= low, tf.constant(dtype.min, dtype), inside))


def _tensor_list(tensors: Any, what: str, items: str = "tensors") -> list:
    """``tensors`` as a list, refusing what would be iterated wrongly: a tensor or a variable
    (its rows), a dict (its keys). A one-shot iterable (a generator, ``itertools.chain``) is
    read once here, so callers may walk the list more than once."""
    if isinstance(tensors, (tf.Tensor, np.ndarray, tf.IndexedSlices, tf.Variable,
                            *_keras_private.variable_classes())):
        single = what.replace("grouped_", "")
        raise TypeError(f"{what} takes a list of {items}, got one {type(tensors).__name__}"
                        + (f"; use {single} for one tensor" if single != what else
                           f"; pass [{items[:-1]}]"))
    if isinstance(tensors, Mapping) or not isinstance(tensors, Iterable):
        # Iterating a dict would reduce its keys.
        raise TypeError(f"{what} takes a list or tuple of {items}, got "
                        f"{type(tensors).__name__}" + ("; pass list(d.values())" if isinstance(tensors, Mapping) else ""))
    return list(tensors)


@tf.autograph.experimental.do_not_convert
def grouped_allreduce(
    tensors: Sequence[Any],
    op: ReduceOp | None = None,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    *,
    average: bool | None = None,
    compression: Any = None,
    device_dense: str = "",
    device_sparse: str = "",
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> list[tf.Tensor | tf.IndexedSlices]:
    """Allreduces a list of tensors as one collective: one fused ring pass per dtype.

    Args:
        tensors: tensors of any shapes and supported dtypes, mixed freely; ``tf.IndexedSlices``
            among them are allgathered as by :func:`allreduce` (Sum and Average).
        op, name, prescale_factor, postscale_factor, average, compression, device_dense,
            device_sparse, ignore_name_scope, process_set: as for :func:`allreduce`.

    Returns:
        The reduced tensors, in the order given.

    Example:

    ```python
    grads = keras_ring.grouped_allreduce(grads, op=keras_ring.Average)
    ```
    """
    del device_dense, device_sparse, ignore_name_scope
    op, tensor_name, pre, post, set_id = _reduce_args(
        "grouped_allreduce", resolve_op(op, average, "grouped_allreduce"), name,
        prescale_factor, postscale_factor, process_set)
    items = _tensor_list(tensors, "grouped_allreduce")
    if compression is not None:
        check_compression(compression, "keras_ring.grouped_allreduce")
    sparse = [i for i, t in enumerate(items) if isinstance(t, tf.IndexedSlices)]
    dense_at = [i for i, t in enumerate(items) if not isinstance(t, tf.IndexedSlices)]
    dense = _tensors([items[i] for i in dense_at], REDUCE_DTYPES, "grouped_allreduce")
    out: list[Any] = list(items)
    if dense:
        wire = [compress(compression, t) for t in dense]
        reduced = _run(wrappers.grouped_allreduce, [w for w, _ in wire], int(op), pre, post,
                       tensor_name, set_id)
        for i, r, (_, ctx) in zip(dense_at, reduced, wire):
            out[i] = decompress(compression, r, ctx)
    for i in sparse:
        out[i] = _allreduce_indexed_slices(items[i], op, f"{tensor_name}.sparse{i}" if tensor_name else "",
                                           pre, post, process_set)
    return out


@tf.autograph.experimental.do_not_convert
def grouped_allgather(tensors: Sequence[Any], name: str | None = None,
                      ignore_name_scope: bool = False,
                      process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """:func:`allgather` of each tensor, in order; each may have its own row count.
    ``ignore_name_scope`` is Horovod's, in its place, and has no effect.

    Example:

    ```python
    features, labels = keras_ring.grouped_allgather([features, labels])
    ```
    """
    del ignore_name_scope
    set_id = resolve(process_set, "grouped_allgather")
    base = _check_name(name)
    tensors = _tensors(_tensor_list(tensors, "grouped_allgather"), GATHER_DTYPES,
                       "grouped_allgather")
    return [_run(wrappers.allgather, t, f"{base}.{i}" if base else "", set_id)
            for i, t in enumerate(tensors)]


@tf.autograph.experimental.do_not_convert
def allgather(tensor: Any, name: str | None = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Concatenates every rank's tensor along the first dimension, in rank order.

    The first dimension may differ between ranks; the others must match. A scalar counts as
    one row, so gathering scalars gives a vector of ``size()`` entries. The arguments are
    Horovod's, in its order; ``ignore_name_scope`` has no effect.

    Example:

    ```python
    all_labels = keras_ring.allgather(labels)  # shape [sum of every rank's batch, ...]
    ```
    """
    del ignore_name_scope
    set_id = resolve(process_set, "allgather")
    tensor = _tensor(tensor, GATHER_DTYPES, "allgather")
    return _run(wrappers.allgather, tensor, _check_name(name), set_id)


@tf.autograph.experimental.do_not_convert
def broadcast(tensor: Any, root_rank: int, name: str | None = None,
              ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Returns the root rank's ``tensor`` on every rank (shapes and dtypes must match).

    With a ``process_set``, on its ranks; ``root_rank`` is still the root's global rank. The
    arguments are Horovod's, in its order; ``ignore_name_scope`` has no effect.

    Example:

    ```python
    w = keras_ring.broadcast(w, root_rank=0)
    ```
    """
    del ignore_name_scope
    set_id = resolve(process_set, "broadcast")
    tensor = _tensor(tensor, GATHER_DTYPES, "broadcast")
    root = root_in_set(_check_root(root_rank), set_id)
    return _run(wrappers.broadcast, tensor, root, _check_name(name), set_id)


def _own_to_each_rank(variable: Any) -> bool:
    """Whether a broadcast may leave ``variable`` alone: the random-seed states of Keras
    layers and an optimizer's gradient accumulators.

    A Keras model's ``variables`` include the seeds its Dropout (and noise and augmentation)
    layers draw from: with the root's seeds every rank would drop the same units and flip the
    same images, and the ranks' samples would share their noise, which one process training
    on the global batch never does (nor did Horovod, whose TF2 Keras kept no seeds in
    variables). Each rank keeps its own, as the processes drew them. An optimizer's
    ``variables`` include, with gradient accumulation, each rank's own sum of the passes so
    far, not yet reduced: the root's would replace the others' gradients (Horovod's loop
    broadcasts the optimizer after its first step, mid-accumulation). Only a rank whose
    optimizer is not in step with the root's takes the root's sums (``_assign_from_root``)."""
    return _keras_private.is_seed_state(variable) or _keras_private.is_gradient_accumulator(
        variable)


def _assign_from_root(variables: Sequence[Any], root: int, base: str,
                      process_set: ProcessSet) -> None:
    """Assigns the root's values to ``variables`` but the seed states, named ``base.i of n``
    (ranks with different lists fail at the first variable, saying how many each has).

    Gradient accumulators follow their optimizer's step counter: a rank whose counter
    differed from the root's before this broadcast (the root resumed from a checkpoint taken
    mid-accumulation, a worker joined) takes the root's sums, so the next update adds what
    the checkpoint had summed, as one process resuming would; a rank in step (Horovod's
    broadcast after the first step) keeps its own, not yet reduced. An optimizer's counter
    comes before its sums in its ``variables``: each sum follows the last counter before it
    (each optimizer of a GAN decides for itself)."""
    shared = _shared_variables(variables)
    owners, counters, latest = [], [], None  # per sum: the index of its optimizer's counter
    for v in variables:
        if _keras_private.is_step_counter(v) and not _own_to_each_rank(v):
            counters.append(v)
            latest = len(counters) - 1
        elif _keras_private.is_gradient_accumulator(v):
            owners.append((v, latest))
    # Sums listed before any counter follow the first; without counters none is sent.
    owners = [(v, owner or 0) for v, owner in owners] if counters else []
    before = [tf.identity(c) for c in counters]
    total = len(shared) + len(owners)
    for i, var in enumerate(shared):
        var.assign(broadcast(tf.convert_to_tensor(var), root, name=f"{base}.{i} of {total}",
                             process_set=process_set))
    for i, (var, owner) in enumerate(owners, len(shared)):
        behind = tf.not_equal(before[owner], tf.convert_to_tensor(counters[owner]))
        root_sum = broadcast(tf.convert_to_tensor(var), root, name=f"{base}.{i} of {total}",
                             process_set=process_set)
        var.assign(tf.where(behind, root_sum, tf.convert_to_tensor(var)))


def _shared_variables(variables: Sequence[Any]) -> list[Any]:
    """``variables`` less those each rank keeps (``_own_to_each_rank``)."""
    return [v for v in variables if not _own_to_each_rank(v)]


@tf.autograph.experimental.do_not_convert
def broadcast_variables(variables: Sequence[Any], root_rank: int,
                        process_set: ProcessSet = global_process_set,
                        inplace: bool = False) -> None:
    """Assigns the root rank's values to ``variables`` (tf or Keras variables) on every rank.
    ``inplace`` is Horovod's choice of implementation, in its place; every assignment here is
    in place.

    The random-seed states of Keras layers (``keras.random.SeedGenerator``, in
    ``model.variables`` but not in ``model.weights``) are left out: each rank keeps drawing
    its own dropout masks and augmentations; so are an optimizer's gradient accumulators
    (each rank's own passes, not yet reduced) on the ranks whose optimizer step counter is
    the root's (a rank out of step, fresh beside a root that resumed mid-accumulation, takes
    the root's sums: they are in the checkpoint it resumes). To give every rank the root's seeds anyway,
    ``v.assign(keras_ring.broadcast(v.value, root_rank))`` them one by one. A Keras
    ``Normalization`` layer reads a copy of its statistics: call its ``finalize_state()``
    after this (``fit`` and ``broadcast_model`` do).

    Example:

    ```python
    keras_ring.broadcast_variables(model.variables, root_rank=0)
    ```
    """
    del inplace
    resolve(process_set, "broadcast_variables")
    variables = _tensor_list(variables, "broadcast_variables", "variables")
    _assign_from_root(variables, root_rank, "broadcast_variables", process_set)


@tf.autograph.experimental.do_not_convert
def broadcast_(variables: Sequence[Any], root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Horovod's in-place broadcast: assigns the root's values to ``variables`` on every rank
    and returns their new values (Keras random-seed states keep and return their own, and
    gradient accumulators where their optimizer is in step with the root's, as in
    :func:`broadcast_variables`). Works eagerly and inside ``tf.function``.

    Example:

    ```python
    keras_ring.broadcast_(model.trainable_variables, root_rank=0)
    ```
    """
    resolve(process_set, "broadcast_")
    root = _check_root(root_rank)
    variables = _tensor_list(variables, "broadcast_", "variables")
    _assign_from_root(variables, root, _check_name(name) or "broadcast_", process_set)
    return [tf.convert_to_tensor(var) for var in variables]


@tf.autograph.experimental.do_not_convert
def broadcast_global_variables(root_rank: int) -> Any:
    """Horovod's TF1-style broadcast of ``tf.compat.v1.global_variables()``: an op that
    assigns the root's values to them, for graphs built with ``tf.compat.v1``.

    TensorFlow 2 keeps no global variable collection, so eagerly (and in ``tf.function``)
    this raises, as Horovod's does; broadcast the model's variables instead.

    Example:

    ```python
    with tf.compat.v1.Session() as sess:
        sess.run(keras_ring.broadcast_global_variables(0))
    ```
    """
    RUNTIME.topology("keras_ring.broadcast_global_variables()")
    if tf.executing_eagerly() or tf.inside_function():
        raise RuntimeError(
            "keras_ring.broadcast_global_variables() broadcasts TensorFlow 1 global variables "
            "and works only in tf.compat.v1 graph mode; in TensorFlow 2 use "
            "keras_ring.broadcast_variables(model.variables, root_rank) or "
            "keras_ring.callbacks.BroadcastGlobalVariablesCallback(root_rank)")
    root = _check_root(root_rank)
    variables = tf.compat.v1.global_variables()
    return tf.group(*[var.assign(broadcast(var, root, name=f"broadcast_global_variables.{i}"))
                      for i, var in enumerate(variables)])


def check_eager(what: str, why: str) -> None:
    """Refuses a call that only works eagerly inside a tf.function, on every rank alike
    (every rank traces alike); ``why`` says what tracing would do and what to do instead."""
    if not tf.executing_eagerly():
        raise RuntimeError(f"keras_ring.{what} runs eagerly only, but was called inside a "
                           f"tf.function (or a graph): {why}")


_TRACED_ONCE = ("traced, it would run once, as the function is traced, and never when the "
                "function is called; call it outside the function")


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Returns once every rank (of ``process_set``) has called it (bounded by
    ``KERAS_RING_TIMEOUT_SECONDS``). Eager only."""
    check_eager("barrier", _TRACED_ONCE)
    set_id = resolve(process_set, "barrier")
    lib = RUNTIME.library("keras_ring.barrier()")
    err = ctypes.create_string_buffer(4096)
    rc = lib.c.keras_ring_barrier(set_id, b"barrier", err, len(err))
    if rc != 0:
        raise errors.for_status_code(rc, err.value.decode(errors="replace"))


def join(process_set: ProcessSet = global_process_set) -> int:
    """Says this rank ran out of data: until every rank has joined, it takes part in the
    other ranks' allreduces (and grouped allreduces, Sum or Average) with zeros, so they can
    finish their epoch; returns the (global) rank that joined last. Horovod's ``join``.

    Averages still divide by ``size()``. Anything else the others run meanwhile (allgather,
    broadcast, Min/Max, GPU tensors) fails on every rank, naming the joined ranks. Each wait
    for the others' next collective is bounded by ``KERAS_RING_TIMEOUT_SECONDS``. Eager only.

    Example:

    ```python
    for batch in my_shard:           # shards of different lengths
        train_step(batch)            # its gradient allreduce
    last = keras_ring.join()
    ```
    """
    check_eager("join", _TRACED_ONCE)
    set_id = resolve(process_set, "join")
    lib = RUNTIME.library("keras_ring.join()")
    err = ctypes.create_string_buffer(4096)
    last = ctypes.c_int(-1)
    rc = lib.c.keras_ring_join(set_id, ctypes.byref(last), err, len(err))
    if rc != 0:
        raise errors.for_status_code(rc, err.value.decode(errors="replace"))
    return RUNTIME.process_set(set_id)[0][last.value]
