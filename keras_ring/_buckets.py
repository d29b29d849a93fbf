"""Gradient reduction shared by ``wrap`` and ``DistributedGradientTape``.

Gradients are reduced in buckets, walking the variables in reverse order: that is the order
in which backprop produces them, so the first bucket's collective can run while backprop of
the earlier layers continues (the collectives are stateful and run in program order, and a
bucket only waits for its own gradients: each bucket's op takes exactly its tensors, nothing
here joins all gradients first). Each bucket is one ``grouped_allreduce``, which the runtime
fuses into one ring pass per dtype. The first bucket may be smaller (``first_bucket_bytes``,
as PyTorch DDP does), so that communication starts after the last layers' gradients instead
of after a full bucket's worth of them; the others are ``bucket_bytes``. Both are ``"auto"``
by default: ``KERAS_RING_BUCKET_BYTES`` if set, else what a measurement at the start of
training chose (``keras_ring._bucket_tuning``; no overlap where no core is free for it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from keras_ring import _xla
from keras_ring._bucket_tuning import FIRST_BYTES, MEASURED
from keras_ring._grouping import Groups
from keras_ring.collectives import (Average, ReduceOp, Sum, allreduce, grouped_allreduce,
                                    op_hint)
from keras_ring.process_sets import ProcessSet, global_process_set
from keras_ring.compression import Compression, casts_only, check_compression
from keras_ring.runtime import RUNTIME

# "auto": KERAS_RING_BUCKET_BYTES, else the size measured at the start of training: large
# enough that a bucket's fixed cost (signature exchange, dispatch, ring latency) is small
# next to its transfer time, small enough that communication overlaps the rest of backprop.
AUTO = "auto"
DEFAULT_BUCKET_BYTES = AUTO
# "auto": PyTorch DDP's first bucket (1 MiB), so the last layers' gradients start
# communicating at once, unless the measurement found no core to overlap on (then none).
DEFAULT_FIRST_BUCKET_BYTES = AUTO


def _check_size(who: str, name: str, value: Any) -> None:
    if value is None or value == AUTO:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        meaning = "one bucket for everything" if name == "bucket_bytes" else "as large as the others"
        raise ValueError(f'{who}: {name} must be a positive int, "auto" or None ({meaning}), '
                         f"got {value!r}")


@dataclass(frozen=True)
class ReduceOptions:
    """Validated options of a gradient reduction (see ``keras_ring.wrap``)."""

    op: ReduceOp = Average
    compression: Any = Compression.none  # a Compressor, or any object of Horovod's shape
    bucket_bytes: int | str | None = DEFAULT_BUCKET_BYTES
    sparse_as_dense: bool = False
    gradient_predivide_factor: float = 1.0
    process_set: ProcessSet = global_process_set  # the ranks that reduce
    first_bucket_bytes: int | str | None = DEFAULT_FIRST_BUCKET_BYTES
    groups: Groups | None = None  # Horovod's explicit groups, in place of buckets
    name: str = "gradients"  # the collectives' names start with it

    @classmethod
    def create(cls, who: str, op: Any, compression: Any, bucket_bytes: Any,
               sparse_as_dense: Any, gradient_predivide_factor: Any,
               process_set: Any = global_process_set,
               first_bucket_bytes: Any = DEFAULT_FIRST_BUCKET_BYTES, *,
               groups: Any = None, num_groups: Any = 0, name: Any = None) -> "ReduceOptions":
        """Checks every option and says what was received when one is wrong."""
        if type(op) is not ReduceOp or op not in (Sum, Average):
            raise ValueError(f"{who}: op must be keras_ring.Sum or keras_ring.Average, "
                             f"got {op!r}{op_hint(op)}")
        compression = check_compression(compression, who)
        _check_size(who, "bucket_bytes", bucket_bytes)
        _check_size(who, "first_bucket_bytes", first_bucket_bytes)
        if not isinstance(sparse_as_dense, bool):
            raise TypeError(f"{who}: sparse_as_dense must be a bool, got {sparse_as_dense!r}")
        factor = gradient_predivide_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (
            math.isfinite(factor) and factor > 0
        ):
            raise ValueError(f"{who}: gradient_predivide_factor must be a positive number, "
                             f"got {factor!r}")
        if factor != 1.0 and op != Average:
            raise ValueError(f"{who}: gradient_predivide_factor={factor!r} needs op=Average "
                             f"(it splits the division by size() around the sum), got op={op.name}")
        if not isinstance(process_set, ProcessSet):
            raise TypeError(f"{who}: process_set must be a keras_ring.ProcessSet, got "
                            f"{type(process_set).__name__}")
        checked_groups = Groups.create(who, groups, num_groups)
        if checked_groups is not None and (bucket_bytes, first_bucket_bytes) != (AUTO, AUTO):
            raise ValueError(f"{who}: groups and bucket_bytes/first_bucket_bytes both decide "
                             f"which gradients travel together; pass one, got {checked_groups!r}, "
                             f"bucket_bytes={bucket_bytes!r}, first_bucket_bytes="
                             f"{first_bucket_bytes!r}")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"{who}: name must be a str or None, got {name!r}")
        return cls(op, compression, bucket_bytes, sparse_as_dense, float(factor), process_set,
                   first_bucket_bytes, checked_groups, name or "gradients")

    def resolved_sizes(self) -> tuple[int | None, int | None]:
        """(bucket_bytes, first_bucket_bytes) to plan with, "auto" resolved.

        ``bucket_bytes="auto"`` is ``KERAS_RING_BUCKET_BYTES`` if set, else measured, and an
        "auto" first bucket is then what the measurement chose (1 MiB where overlap can
        pay, else none); with a bucket size given, it is 1 MiB. Measuring is a collective:
        every rank resolves at the same point (the first reduction), once per set and job.
        """
        size, first = self.bucket_bytes, self.first_bucket_bytes
        if size == AUTO and RUNTIME.initialized and RUNTIME.config.bucket_bytes is not None:
            size = RUNTIME.config.bucket_bytes
        if size == AUTO:
            plan = MEASURED.plan(self.process_set)
            size = plan.bucket_bytes
            first = plan.first_bucket_bytes if first == AUTO else first
        elif first == AUTO:
            first = FIRST_BYTES
        return size, first

    @property
    def scale_factors(self) -> tuple[float, float]:
        """(prescale, postscale): Average with factor f sums x / f and multiplies by f / size."""
        f = self.gradient_predivide_factor
        return 1.0 / f, f


def plan_buckets(sizes: Sequence[int], bucket_bytes: int | None,
                 first_bucket_bytes: int | None = None) -> list[list[int]]:
    """Groups positions ``0..len(sizes)-1`` into consecutive buckets of at most ``bucket_bytes``.

    The first bucket holds at most ``first_bucket_bytes`` (if given and smaller). A tensor
    larger than its bucket's limit gets a bucket of its own; ``bucket_bytes=None`` means one
    bucket for everything (then ``first_bucket_bytes`` does not split it either).
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    limit = bucket_bytes
    if bucket_bytes is not None and first_bucket_bytes is not None:
        limit = min(first_bucket_bytes, bucket_bytes)
    for position, nbytes in enumerate(sizes):
        if current and limit is not None and filled + nbytes > limit:
            buckets.append(current)
            current, filled = [], 0
            limit = bucket_bytes
        current.append(position)
        filled += nbytes
    if current:
        buckets.append(current)
    return buckets


def map_gradient(grad: Any, fn: Any) -> Any:
    """``fn`` applied to a gradient's values: a tensor's, or a ``tf.IndexedSlices``'s rows."""
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(fn(grad.values), grad.indices, grad.dense_shape)
    return fn(grad)


def _wire_bytes(wire: tf.Tensor) -> int:
    elements = wire.shape.num_elements()
    # An unknown shape cannot be sized here; it then simply joins the open bucket.
    return (elements or 0) * wire.dtype.size


def _reduce_dense(wire: list[tf.Tensor], options: ReduceOptions, name: str) -> list[tf.Tensor]:
    prescale, postscale = options.scale_factors
    return grouped_allreduce(wire, op=options.op, name=name, prescale_factor=prescale,
                             postscale_factor=postscale, process_set=options.process_set)


def _reduce_sparse(grad: tf.IndexedSlices, options: ReduceOptions, name: str) -> tf.IndexedSlices:
    # Allgather of values and indices: rows that several ranks touch then appear once per
    # rank, and the optimizers sum duplicates, which is what a dense allreduce would give.
    # Only keras_ring's casts apply here (Horovod compresses no sparse values): a user's
    # compressor's context describes this rank's values, not the rows gathered from all.
    prescale, postscale = options.scale_factors
    compression = options.compression if casts_only(options.compression) else Compression.none
    values, ctx = compression.compress(grad.values)
    reduced = allreduce(tf.IndexedSlices(values, grad.indices, grad.dense_shape), op=options.op,
                        name=name, prescale_factor=prescale, postscale_factor=postscale,
                        process_set=options.process_set)
    values = compression.decompress(reduced.values, ctx)
    return tf.IndexedSlices(values, reduced.indices, reduced.dense_shape)


# Our control flow is plain Python on structure (None, IndexedSlices, sizes), never on
# tensor values: autograph need not (and, converting it on every trace, should not) touch it.
@tf.autograph.experimental.do_not_convert
def reduce_gradients(grads: Sequence[Any], options: ReduceOptions, name: str | None = None,
                     sources: Sequence[Any] | None = None) -> list[Any]:
    """Allreduces ``grads`` (tensors, ``tf.IndexedSlices`` or None) and returns them in order.

    ``None`` entries stay ``None`` and take no part. Their positions are part of the first
    collective's name, so ranks whose ``None`` entries differ (a data-dependent branch left
    different variables unused) fail on every rank with a mismatch error that says so,
    instead of reducing one variable's gradient into another's. ``name`` starts the
    collectives' names (``options.name`` by default); ``sources`` are the gradients'
    variables, which ``options.groups`` may name (None if unknown).
    """
    _xla.check_not_xla_compiled("reducing gradients")
    name = name or options.name
    missing = _missing_tag(grads)
    out: list[Any] = [None] * len(grads)
    dense_positions: list[int] = []
    wire: list[tf.Tensor] = []
    contexts: list[Any] = []
    for i in reversed(range(len(grads))):
        grad = grads[i]
        if grad is None:
            continue
        if isinstance(grad, tf.IndexedSlices) and not options.sparse_as_dense:
            out[i] = _reduce_sparse(grad, options, f"{name}.sparse{len(grads) - 1 - i}")
            continue
        # Compressed first, so that buckets are sized by what travels, whatever the
        # compressor does to dtypes and shapes.
        tensor, ctx = options.compression.compress(tf.convert_to_tensor(grad))
        dense_positions.append(i)
        wire.append(tf.convert_to_tensor(tensor))
        contexts.append(ctx)
    for k, bucket in enumerate(_plan(wire, dense_positions, sources, options)):
        reduced = _reduce_dense([wire[j] for j in bucket], options,
                                f"{name}.bucket{k}{missing if k == 0 else ''}")
        for j, r in zip(bucket, reduced):
            out[dense_positions[j]] = options.compression.decompress(r, contexts[j])
    if missing and not wire:  # nothing dense to reduce: still meet the others, by name
        _reduce_dense([tf.zeros([0])], options, f"{name}.bucket0{missing}")
    return out


def _plan(wire: list[tf.Tensor], positions: list[int], sources: Sequence[Any] | None,
          options: ReduceOptions) -> list[list[int]]:
    """The collectives for ``wire`` (the gradients of ``positions``): groups, or buckets."""
    if options.groups is not None:
        return options.groups.plan(len(wire), None if sources is None else
                                   [sources[i] for i in positions], "keras_ring: groups")
    sizes = [_wire_bytes(w) for w in wire]
    bucket_bytes, first_bucket_bytes = options.resolved_sizes() if wire else (None, None)
    return plan_buckets(sizes, bucket_bytes, first_bucket_bytes)


def _missing_tag(grads: Sequence[Any]) -> str:
    """Where ``grads`` has no gradient, for the first bucket's name: "" if everywhere."""
    positions = [i for i, g in enumerate(grads) if g is None]
    if not positions:
        return ""
    runs: list[str] = []  # "0-3,7": readable in the mismatch error for a few layers' worth
    for i in positions:
        if runs and i == last + 1:
            runs[-1] = f"{runs[-1].split('-')[0]}-{i}"
        else:
            runs.append(str(i))
        last = i
    return f" (no gradient for sources {','.join(runs)} of {len(grads)})"
