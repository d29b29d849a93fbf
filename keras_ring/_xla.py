"""XLA and keras_ring: the collectives have no XLA kernel, so XLA is turned off explicitly.

Keras compiles the training step with XLA when ``jit_compile=True``, and picks that for GPU
machines with the default ``jit_compile="auto"``. XLA would then reject keras_ring's ops with
an "unsupported op" error at the first step. Two guards prevent that:

- ``Model.compile`` with a ``keras_ring.wrap()`` optimizer turns ``jit_compile`` off, with one
  warning per process (see ``keras_ring.optimizer``), and so does ``fit`` as it first traces
  the step of a model that holds wrapped optimizers compile did not see (keras-io's GAN);
- a gradient reduction traced inside an XLA-compiled function (a custom loop under
  ``tf.function(jit_compile=True)``) raises :class:`JitCompileError` saying what to change,
  as any collective op made there does (``keras_ring.ops.xla``).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

from keras_ring.ops.xla import JitCompileError, check_not_xla_compiled, in_xla_context

__all__ = ["JitCompileError", "check_not_xla_compiled", "in_xla_context", "turn_off_model_jit"]

_warned = False
_REQUESTED = "_keras_ring_requested_jit"  # what the model's latest compile asked for
_GUARDED = "_keras_ring_jit_guard"


def turn_off_model_jit(model: Any, requested: Any) -> bool:
    """Sets ``model.jit_compile = False`` if it is on; warns once per process. True if it was on."""
    global _warned
    if not getattr(model, "jit_compile", False):
        return False
    model.jit_compile = False
    if not _warned:
        _warned = True
        why = ("Keras picks XLA on GPU machines when jit_compile='auto'"
               if requested == "auto" else f"model.compile got jit_compile={requested!r}")
        warnings.warn(
            f"keras_ring: turning XLA off for the training step ({why}): keras_ring's "
            "collectives have no XLA kernel. Pass jit_compile=False to model.compile to "
            "silence this warning.",
            UserWarning,
            stacklevel=4,
        )
    return True


def turn_off_before_tracing(model: Any, requested: Any, communicates: Callable[[], bool]) -> None:
    """Turns XLA off (as :func:`turn_off_model_jit`) when ``model``'s training function is
    made and ``communicates()`` is then true: wrapped optimizers may reach the model only
    after ``compile`` (keras-io's GAN calls ``super().compile()`` with none and sets its own
    as attributes), and ``jit_compile="auto"`` picks XLA on GPU machines."""
    setattr(model, _REQUESTED, requested)
    if getattr(model, _GUARDED, False) or not hasattr(model, "make_train_function"):
        return
    original = model.make_train_function

    def make_train_function(force: bool = False):
        if communicates():
            turn_off_model_jit(model, getattr(model, _REQUESTED, "auto"))
        return original(force=force)

    model.make_train_function = make_train_function
    setattr(model, _GUARDED, True)
