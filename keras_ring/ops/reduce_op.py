"""How allreduce combines the ranks' values: the one Python definition of the numbering.

The values are part of the op library's ABI: they mirror ``enum class ReduceOp`` in
``cc/core/common.h`` (a unit test compares the two).
"""

from __future__ import annotations

import enum


class ReduceOp(enum.IntEnum):
    """How allreduce combines the ranks' values (the values are part of the op library ABI)."""

    Sum = 0
    Average = 1
    Min = 2
    Max = 3
    Product = 4
