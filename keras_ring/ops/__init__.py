"""The TensorFlow op library: building, loading, op wrappers and their gradients."""

from keras_ring.ops.loader import Library, OpLibraryError, library

__all__ = ["Library", "OpLibraryError", "library"]
