"""The TensorFlow op library: building, loading, op wrappers and their gradients.

Submodules load lazily, so ``python -m keras_ring.ops.build`` runs without importing the
loader first.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Library", "OpLibraryError", "library"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("keras_ring.ops.loader"), name)
    raise AttributeError(f"module 'keras_ring.ops' has no attribute {name!r}")
