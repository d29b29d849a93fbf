"""``DistributedGradientTape``: a ``tf.GradientTape`` whose gradients are reduced over ranks."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from keras_ring import _step_check
from keras_ring._accumulation import Passes, accumulator_for
from keras_ring._buckets import DEFAULT_BUCKET_BYTES, DEFAULT_FIRST_BUCKET_BYTES, ReduceOptions
from keras_ring._local import LocalSources, check_local_layers, check_scale, reduce_partially
from keras_ring.collectives import Average, ReduceOp
from keras_ring.compression import Compression, Compressor
from keras_ring.ops.wrappers import note_collective
from keras_ring.process_sets import ProcessSet, global_process_set

_WHO = "keras_ring.DistributedGradientTape"


class DistributedGradientTape:
    """Wraps a ``tf.GradientTape`` so that ``gradient()`` returns gradients reduced over ranks.

    ``gradient(target, sources)`` computes this rank's gradients with the wrapped tape, then
    allreduces them exactly as :func:`keras_ring.wrap` does (buckets in reverse source order,
    ``None`` gradients skipped, ``tf.IndexedSlices`` allgathered unless ``sparse_as_dense``).
    Use it with a plain optimizer; everything else (``watch``, ``jacobian``, ...) is the
    wrapped tape's. It works eagerly and inside ``tf.function`` (without ``jit_compile``).

    With ``backward_passes_per_step=N`` each ``gradient()`` call is one backward pass: the
    gradients are added up locally and the ranks communicate on every N-th call only. That
    call returns the reduced sum of the N passes (divided by N if
    ``average_aggregated_gradients``); the other calls return zeros, and
    :attr:`update_step` says which is which: apply the gradients only when it is true.
    The sums belong to the sources (the same objects in the same order), not to this tape
    object, so a tape made anew in every step keeps counting; they are kept densely, so
    ``tf.IndexedSlices`` are densified. Horovod's own tape has no such option; this follows
    its ``DistributedOptimizer(backward_passes_per_step=...)``.

    Args:
        tape: the ``tf.GradientTape`` to wrap, usually right after its ``with`` block.
        op, compression, bucket_bytes, first_bucket_bytes, sparse_as_dense,
            gradient_predivide_factor: as for :func:`keras_ring.wrap`; ``compression`` may
            also be a Horovod-style compressor.
        backward_passes_per_step: backward passes (``gradient()`` calls) per communication.
            Default 1: every call communicates.
        average_aggregated_gradients: divide the sum of the passes by their number.
        scale_local_gradients: divide the gradients of local sources (see
            :meth:`register_local_source`) by ``size()``, as Horovod does. Default True.
        process_set: the ranks that reduce the gradients; all by default. On a rank outside
            it, ``gradient()`` returns the rank's own gradients, as Horovod's tape does.
        groups, num_groups, device_dense, device_sparse: as for :func:`keras_ring.wrap`
            (Horovod's explicit fusion; placement accepted and ignored).

    Example:

    ```python
    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = keras_ring.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    ```

    With accumulation (build the optimizer first: variables cannot be made inside the
    ``if``, which autograph turns into a ``tf.cond``):

    ```python
    optimizer.build(model.trainable_variables)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = keras_ring.DistributedGradientTape(tape, backward_passes_per_step=4,
                                                  average_aggregated_gradients=True)
        grads = tape.gradient(loss, model.trainable_variables)
        if tape.update_step:
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
    ```
    """

    def __init__(
        self,
        tape: tf.GradientTape,
        *,
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
        device_dense: str = "",
        device_sparse: str = "",
    ) -> None:
        if not isinstance(tape, tf.GradientTape):
            raise TypeError("keras_ring.DistributedGradientTape wraps a tf.GradientTape, got "
                            f"{type(tape).__module__}.{type(tape).__qualname__}")
        self._tape = tape
        del device_dense, device_sparse
        self._options = ReduceOptions.create(
            _WHO, op, compression, bucket_bytes, sparse_as_dense, gradient_predivide_factor,
            process_set, first_bucket_bytes, groups=groups, num_groups=num_groups,
        )
        self._passes = Passes.create(_WHO, backward_passes_per_step, average_aggregated_gradients)
        self._local = LocalSources(scale=check_scale(scale_local_gradients, _WHO))
        self._update_step: Any = None

    @property
    def tape(self) -> tf.GradientTape:
        """The wrapped ``tf.GradientTape``."""
        return self._tape

    @property
    def update_step(self) -> Any:
        """Whether the gradients of the last ``gradient()`` call are to be applied.

        True (a Python bool) without accumulation; with ``backward_passes_per_step`` a
        boolean scalar tensor, true on every N-th pass.
        """
        if self._passes.steps == 1:
            return True
        if self._update_step is None:
            raise ValueError(f"{_WHO}.update_step: gradient() has not been called yet")
        return self._update_step

    def register_local_source(self, source: Any) -> None:
        """Keeps ``source``'s gradient on this rank: it is not reduced (Horovod's method).

        It is divided by ``size()`` unless the tape was made with
        ``scale_local_gradients=False``.
        """
        self._local.register(source)

    @tf.autograph.experimental.do_not_convert
    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 unconnected_gradients: tf.UnconnectedGradients = tf.UnconnectedGradients.NONE,
                 *, use_generic_names: bool = False) -> Any:
        """This rank's ``tape.gradient(...)``, reduced over all ranks; same structure as ``sources``.

        ``use_generic_names`` (Horovod's choice of names for the collectives) is accepted and
        has no effect: keras_ring names the collectives itself, alike on every rank. A bool in
        fourth place is that argument, where Horovod's signature puts it.
        """
        if isinstance(unconnected_gradients, bool):  # Horovod's positional use_generic_names
            unconnected_gradients = tf.UnconnectedGradients.NONE
        del use_generic_names
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients,
                                    unconnected_gradients=unconnected_gradients)
        if self._options.process_set.included() is False:
            return grads  # Horovod's rule: a rank outside the set keeps its own gradients
        flat = tf.nest.flatten(grads, expand_composites=False)
        flat_sources = tf.nest.flatten(sources, expand_composites=False)
        checks = _step_check.before_reduce(
            flat_sources, self._local.keys(), self._options.process_set, self._passes.steps,
            f"in {_WHO}.gradient", "PartialDistributedGradientTape")
        with tf.control_dependencies(checks):
            if self._passes.steps > 1:
                reduced = self._accumulate(flat, flat_sources)
            else:
                reduced = reduce_partially(flat, flat_sources, self._options, self._local)
        return tf.nest.pack_sequence_as(grads, reduced, expand_composites=False)

    def _accumulate(self, grads: list, sources: list) -> list:
        steps = self._passes.steps
        accumulator = accumulator_for(sources, grads, steps)
        totals, self._update_step = accumulator.add(grads)
        note_collective()  # run eagerly, a pass that only adds up makes none, yet averages
        live = [i for i, t in enumerate(totals) if t is not None]

        def update():
            values = [tf.convert_to_tensor(totals[i]) for i in live]
            reduced = reduce_partially(values, [sources[i] for i in live], self._options,
                                       self._local, name=f"{self._options.name}.accumulated")
            if self._passes.average:  # the passes' gradients; a new value is no sum
                reduced = [r if accumulator.new_values[i] else r / steps
                           for i, r in zip(live, reduced)]
            with tf.control_dependencies(reduced):
                resets = accumulator.reset()
            with tf.control_dependencies(resets):
                return [tf.identity(r) for r in reduced]

        def skip():
            return [tf.zeros_like(totals[i]) for i in live]

        # Every rank counts the same passes, so every rank takes the same branch.
        out: list[Any] = [None] * len(grads)
        for i, r in zip(live, tf.cond(self._update_step, update, skip)):
            out[i] = r
        return out

    # The tape is also usable as its own context manager: `with DistributedGradientTape(
    # tf.GradientTape()) as tape:` records into the wrapped tape.
    def __enter__(self) -> "DistributedGradientTape":
        self._tape.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> Any:
        return self._tape.__exit__(*exc_info)

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes not found here: watch, stop_recording, jacobian, ...
        if name.startswith("__") or name in ("_tape", "_options", "_passes", "_local",
                                             "_update_step"):
            raise AttributeError(name)
        return getattr(self._tape, name)


def PartialDistributedGradientTape(  # noqa: N802 - Horovod's name
    tape: tf.GradientTape,
    *,
    local_layers: keras.layers.Layer | list[keras.layers.Layer] | None = None,
    **options: Any,
) -> DistributedGradientTape:
    """:class:`DistributedGradientTape`, except that the gradients of ``local_layers`` stay local.

    Each rank gets its own gradients for those layers' trainable weights (divided by
    ``size()`` unless ``scale_local_gradients=False``), and the reduced ones for the rest.

    Args:
        tape: the ``tf.GradientTape`` to wrap.
        local_layers: a ``keras.layers.Layer`` or a list of them, or None (then this is
            :class:`DistributedGradientTape`).
        **options: :class:`DistributedGradientTape`'s keyword arguments.

    Example:

    ```python
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    tape = keras_ring.PartialDistributedGradientTape(tape, local_layers=[model.layers[-1]])
    grads = tape.gradient(loss, model.trainable_variables)
    ```
    """
    layers = check_local_layers(local_layers, "keras_ring.PartialDistributedGradientTape")
    distributed = DistributedGradientTape(tape, **options)
    distributed._local.layers.extend(layers)
    return distributed
