"""Collectives that give each rank a different part: reducescatter and alltoall.

Both split along the first dimension, work eagerly and inside ``tf.function``, have
gradients (Horovod's), and are checked across ranks like every collective: dtypes and
shapes before any data moves, and the splits of an alltoall on every rank alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from keras_ring import collectives as _c
from keras_ring.compression import Compression, Compressor, check_compression
from keras_ring.ops import wrappers
from keras_ring.ops.reduce_op import ReduceOp
from keras_ring.process_sets import ProcessSet, global_process_set, resolve, set_rank, set_size


def _set_rows(out: tf.Tensor, tensor: tf.Tensor, rows: int | None) -> tf.Tensor:
    # The op cannot know this rank's rows; with static input shapes Python can.
    if rows is not None and tensor.shape.rank is not None:
        out.set_shape([rows, *tensor.shape[1:]])
    return out


def reducescatter_rows(rows: int, size: int, rank: int) -> int:
    """How many of ``rows`` rows rank ``rank`` of ``size`` gets: the first ``rows % size``
    ranks one more than the others (Horovod's rule)."""
    return rows // size + (1 if rank < rows % size else 0)


@tf.autograph.experimental.do_not_convert
def reducescatter(
    tensor: Any,
    device_dense: str = "",
    compression: Compressor = Compression.none,
    op: ReduceOp = _c.Average,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> tf.Tensor:
    """Reduces ``tensor`` over all ranks and gives each rank its part of the first dimension.

    Rank ``r`` gets rows ``[start_r, start_r + rows_r)`` of the reduction, where the first
    ``rows % size()`` ranks get one row more than the others (Horovod's split). It moves
    about half the data of an allreduce of the same tensor. The arguments are
    ``horovod.tensorflow.reducescatter``'s, in its order.

    Args:
        tensor: a tensor of rank >= 1 and a supported dtype, of the same shape on every rank.
        device_dense, ignore_name_scope: accepted for Horovod compatibility; TensorFlow's
            placement and the explicit ``name`` decide instead.
        compression: compresses the tensor for the wire (``Compression.fp16``) and restores
            its dtype afterwards.
        op: ``Sum``, ``Average``, ``Min``, ``Max`` or ``Product``.
        name: a name shared by all ranks; it is checked across ranks and used in errors.
        prescale_factor, postscale_factor: as for :func:`keras_ring.allreduce`.
        process_set: the ranks that take part (and split the rows); all by default.

    Returns:
        This rank's part: the input's shape with ``rows_r`` rows.

    Example:

    ```python
    shard = keras_ring.reducescatter(grads, op=keras_ring.Sum)
    ```
    """
    del device_dense, ignore_name_scope
    if isinstance(compression, ReduceOp):  # hvd.keras.reducescatter(value, name, op)
        raise TypeError(
            f"keras_ring.reducescatter: got the op {compression.name} as compression: "
            "horovod.tensorflow.keras's reducescatter takes (value, name, op), keras_ring's "
            "takes horovod.tensorflow's (tensor, device_dense, compression, op, name, ...); "
            "pass name= and op= by keyword")
    if compression is not None:
        check_compression(compression, "keras_ring.reducescatter")
    op, tensor_name, pre, post, set_id = _c._reduce_args(
        "reducescatter", op, name, prescale_factor, postscale_factor, process_set)
    tensor = _c._tensor(tensor, _c.REDUCE_DTYPES, "reducescatter")
    compressed, ctx = _c.compress(compression, tensor)
    out = _c._run(wrappers.reducescatter, compressed, int(op), pre, post, tensor_name, set_id)
    rows = tensor.shape[0] if tensor.shape.rank else None
    out = _set_rows(out, compressed, None if rows is None else
                    reducescatter_rows(rows, set_size(set_id), set_rank(set_id)))
    return _c.decompress(compression, out, ctx)


@tf.autograph.experimental.do_not_convert
def grouped_reducescatter(
    tensors: Sequence[Any],
    device_dense: str = "",
    compression: Compressor = Compression.none,
    op: ReduceOp = _c.Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    *,
    name: str | None = None,
) -> list[tf.Tensor]:
    """:func:`reducescatter` of each tensor, in order (one collective each). The positional
    arguments are ``horovod.tensorflow.grouped_reducescatter``'s, in its order (it has no
    name; keras_ring's names the collectives ``name.0``, ``name.1``, ...).

    Example:

    ```python
    shards = keras_ring.grouped_reducescatter([w_grad, b_grad], op=keras_ring.Sum)
    ```
    """
    tensors = _c._tensor_list(tensors, "grouped_reducescatter")
    base = _c._check_name(name)
    return [reducescatter(t, device_dense, compression, op, f"{base}.{i}" if base else None,
                          process_set, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor)
            for i, t in enumerate(tensors)]


def _splits_tensor(splits: Any) -> tf.Tensor:
    """``splits`` as the op's int32 vector. Values that are no row counts (negative, or beyond
    int32: clamped to its range) go on to the runtime, which checks every rank's splits after
    the signatures and fails them on every rank alike, naming the rank; refused here, on one
    rank only, the others would wait for its data."""
    low, high = np.iinfo(np.int32).min, np.iinfo(np.int32).max
    if isinstance(splits, (tf.Tensor, tf.Variable)):
        if not splits.dtype.is_integer:
            raise TypeError(f"keras_ring.alltoall: splits must be integers, got {splits.dtype.name}")
        if splits.shape.rank not in (None, 1):
            raise ValueError("keras_ring.alltoall: splits must be a vector (one entry per rank), "
                             f"got shape {splits.shape}")
        if splits.dtype == tf.int32:
            return splits
        if splits.dtype.max > high or splits.dtype.min < low:
            splits = tf.clip_by_value(splits, tf.cast(max(low, splits.dtype.min), splits.dtype),
                                      tf.cast(high, splits.dtype))
        return tf.cast(splits, tf.int32)
    array = np.asarray(splits)
    if array.ndim != 1 or not (array.size == 0 or np.issubdtype(array.dtype, np.integer)):
        raise TypeError("keras_ring.alltoall: splits must be a vector of integers (one per rank), "
                        f"got {splits!r}")
    return tf.constant([min(max(int(v), low), high) for v in array], tf.int32, shape=[array.size])


@tf.autograph.experimental.do_not_convert
def alltoall(
    tensor: Any,
    splits: Any = None,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> tf.Tensor | tuple[tf.Tensor, tf.Tensor]:
    """Sends ``splits[p]`` rows of ``tensor`` to rank ``p`` and concatenates what every rank
    sent here, in rank order.

    Every rank splits its own first dimension: ``splits`` has one entry per rank and sums to
    this rank's rows; without it the rows are split equally (they must divide by
    ``size()``). The other dimensions and the dtype must match across ranks. Splits that do
    not fit are an error on every rank, naming the rank.

    Args:
        tensor: a tensor of rank >= 1 and a supported dtype (bool too).
        splits: rows for each rank, in rank order (a list or an integer tensor), or None.
        name: a name shared by all ranks; it is checked across ranks and used in errors.
        ignore_name_scope: accepted for Horovod compatibility.
        process_set: the ranks that exchange (``splits`` has one entry per rank of the set).

    Returns:
        The received rows; with ``splits`` given, also ``received_splits``: how many rows came
        from each rank (an int32 vector), as Horovod returns them.

    Example:

    ```python
    tokens, counts = keras_ring.alltoall(tokens, splits=tokens_per_expert)
    ```
    """
    del ignore_name_scope
    set_id = resolve(process_set, "alltoall")
    tensor = _c._tensor(tensor, _c.GATHER_DTYPES, "alltoall")
    split_tensor = tf.constant([], tf.int32) if splits is None else _splits_tensor(splits)
    out, received = _c._run(wrappers.alltoall, tensor, split_tensor, _c._check_name(name),
                            set_id)
    received.set_shape([set_size(set_id)])
    return out if splits is None else (out, received)
