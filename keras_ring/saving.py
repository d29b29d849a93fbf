"""``keras_ring.load_model``: a saved model, its optimizer distributed again (Horovod's)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from typing import Any

import keras

from keras_ring._model_optimizers import after_compile
from keras_ring.compression import Compression, Compressor
from keras_ring.optimizer import is_wrapped, wrap
# Imported for its registration: a saved SyncBatchNormalization loads by its registered name.
from keras_ring.sync_batch_normalization import SyncBatchNormalization  # noqa: F401


def load_model(
    filepath: str | os.PathLike,
    custom_optimizers: Iterable[type] | None = None,
    custom_objects: dict[str, Any] | None = None,
    compression: Compressor | Any = Compression.none,
    legacy_opts: bool = False,
    *,
    compile: bool = True,  # noqa: A002 - keras.models.load_model's name
    safe_mode: bool = True,
    **wrap_options: Any,
) -> keras.Model:
    """Loads a model saved during keras_ring training, with its optimizer wrapped again.

    The model is loaded with ``keras.models.load_model``, which restores the optimizer's
    state (its slots, iteration count and learning rate); that optimizer is then passed to
    :func:`keras_ring.wrap` in place, so training resumes where it stopped, distributed.
    The model is compiled as ``Model.compile`` with a wrapped optimizer would leave it
    (XLA off; under ``mixed_float16`` the ``LossScaleOptimizer`` communicates). Models with
    ``keras_ring.SyncBatchNormalization`` layers load too.

    Args:
        filepath: the saved model (``.keras``, or what ``keras.models.load_model`` reads).
        custom_optimizers: optimizer classes of your own that the saved model uses.
        custom_objects: other classes and functions the model needs, by name.
        compression: as for :func:`keras_ring.wrap`.
        legacy_opts: Horovod's switch for ``tf.keras``'s legacy optimizers, which Keras 3
            does not have; only False is accepted.
        compile: as for ``keras.models.load_model``; with False the model has no optimizer
            and nothing is wrapped.
        safe_mode: as for ``keras.models.load_model``.
        **wrap_options: more keyword arguments of :func:`keras_ring.wrap` (``op``,
            ``backward_passes_per_step``, ...). Pass the ``backward_passes_per_step`` and
            ``average_aggregated_gradients`` the model was trained with: the saved
            optimizer has only the first, as ``gradient_accumulation_steps`` (a warning
            says so where it accumulates and neither was given). A checkpoint saved in the
            middle of an update holds the saving rank's own sum of that update's passes,
            which the next update adds as every rank's: that update differs from an
            uninterrupted run's; save where updates end to resume exactly.

    Returns:
        The model; ``model.optimizer`` is distributed.

    Example:

    ```python
    keras_ring.init()
    model = keras_ring.load_model("checkpoint.keras")
    model.fit(x, y, callbacks=[keras_ring.callbacks.BroadcastGlobalVariablesCallback(0)])
    ```
    """
    if legacy_opts:
        raise ValueError("keras_ring.load_model: legacy_opts=True asks for tf.keras's legacy "
                         "optimizers, which Keras 3 does not have; got legacy_opts=True")
    objects = {cls.__name__: cls for cls in custom_optimizers or ()}
    objects.update(custom_objects or {})
    model = keras.models.load_model(filepath, custom_objects=objects, compile=compile,
                                    safe_mode=safe_mode)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or is_wrapped(optimizer):
        return model
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        # Wrap the inner one, as compile under mixed_float16 does; after_compile then
        # moves the communication to the LossScaleOptimizer.
        optimizer = optimizer.inner_optimizer
    _warn_about_accumulation(optimizer, wrap_options)
    wrap(optimizer, compression=compression, **wrap_options)
    after_compile(model, "auto")
    return model


def _warn_about_accumulation(optimizer: Any, wrap_options: dict[str, Any]) -> None:
    """Warns where the restored optimizer accumulates passes and nothing says how: the file
    cannot tell keras_ring's ``backward_passes_per_step`` (the passes' sum, by default) from
    Keras's own ``gradient_accumulation_steps`` (their mean), and the wrong one scales every
    resumed update silently."""
    steps = getattr(optimizer, "gradient_accumulation_steps", None) or 1
    if steps > 1 and "backward_passes_per_step" not in wrap_options:
        warnings.warn(
            f"keras_ring.load_model: the saved {type(optimizer).__name__} accumulates {steps} "
            "passes per update, and no backward_passes_per_step was given, so its updates "
            "take the passes' mean. If it was trained with keras_ring's "
            f"backward_passes_per_step={steps}, pass that again (with the same "
            f"average_aggregated_gradients), or the sum it trained with becomes a {steps}x "
            "smaller mean; if with Keras's gradient_accumulation_steps, pass "
            f"backward_passes_per_step={steps}, average_aggregated_gradients=True",
            stacklevel=3)
