"""Packaging entry point; metadata lives in pyproject.toml.

The op library is not compiled here: it must match the TensorFlow found at run time, so
keras_ring builds it on first import (or ``python -m keras_ring.ops.build``).
"""

from setuptools import setup

setup()
