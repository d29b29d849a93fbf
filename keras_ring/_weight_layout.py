"""Which weights each rank trains, and the row the weight checks allgather.

Fingerprints compared by position mean nothing where the ranks train different weights: a
layer frozen on some ranks only (also crosswise, two layers of one shape, where the counts
agree) or models built differently. Each rank's row therefore carries tags, which say which
variables these are, ahead of their fingerprints: ``[tag count, print count, tags...,
prints...]``. Ranks whose tags differ fail at once, on every rank, with the difference named;
no broadcast mends it.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import tensorflow as tf

SHOWN = 3  # weights named in an error


def label(variable: Any) -> str:
    return str(getattr(variable, "path", None) or variable.name)


def _shape_tag(variable: Any) -> int:
    return zlib.crc32(f"{tf.as_dtype(variable.dtype).name}{list(variable.shape)}".encode())


class Layout:
    """Tags a custom loop's list of variables by dtype and shape: all such a list tells.
    Subclasses tag more; ``describe`` names a difference using this rank's objects only (the
    other rank's tags may index nothing here)."""

    def __init__(self, variables: list[Any]) -> None:
        self.variables = variables
        self.tags = [_shape_tag(v) for v in variables]

    def describe(self, mine: list[int], other: list[int], first: int, rank: int) -> str:
        """What differs between ``mine`` (rank ``first``'s tags) and rank ``rank``'s."""
        if len(mine) != len(other):
            return f"rank {first} passes {len(mine)} variables, rank {rank} passes {len(other)}"
        index = next(i for i, (a, b) in enumerate(zip(mine, other)) if a != b)
        here = (f" ('{label(self.variables[index])}' on this rank)"
                if index < len(self.variables) else "")
        return (f"variable {index}{here} has another dtype or shape on rank {rank} than on "
                f"rank {first}")


class ModelLayout(Layout):
    """Tags the variables by their place in ``model.weights`` (which trainable flags do not
    change, and layer names, which may differ by rank, do not enter) and their dtype and
    shape; two leading tags describe the whole model, so models built differently are told
    apart from flags set differently."""

    def __init__(self, model: Any, variables: list[Any]) -> None:
        self.weights = list(model.weights)
        self.variables = variables
        places = {id(w): i for i, w in enumerate(self.weights)}
        shapes = zlib.crc32(b"".join(_shape_tag(w).to_bytes(4, "little") for w in self.weights))
        self.tags = [len(self.weights), shapes] + [
            (places.get(id(v), 2**31 - 1) << 32) | _shape_tag(v) for v in variables]

    def describe(self, mine: list[int], other: list[int], first: int, rank: int) -> str:
        if mine[:2] != other[:2]:
            return (f"the ranks built different models: rank {first}'s has {mine[0]} weights, "
                    f"rank {rank}'s {other[0]}" + (", of other dtypes or shapes"
                                                   if mine[0] == other[0] else ""))
        ours, theirs = mine[2:], other[2:]
        parts = [f"rank {first} trains {len(ours)} weights, rank {rank} trains {len(theirs)}"]
        for who, a, b in ((first, ours, theirs), (rank, theirs, ours)):
            only = sorted(set(a) - set(b))
            if only:
                parts.append(f"only rank {who} trains {self._named(only)}")
        return "; ".join(parts)

    def _named(self, tags: list[int]) -> str:
        places = [t >> 32 for t in tags]
        shown = ", ".join(f"'{label(self.weights[p])}'" for p in places[:SHOWN]
                          if p < len(self.weights))
        return (shown or f"{len(tags)} variables") + (", ..." if len(tags) > SHOWN else "")


def row(layout: Layout, prints: list[tf.Tensor]) -> tf.Tensor:
    """This rank's row: ``[len(tags), len(prints), tags..., prints...]`` (int64)."""
    head = tf.constant([len(layout.tags), len(prints)] + layout.tags, tf.int64)
    return tf.concat([head, tf.stack(prints) if prints else tf.zeros([0], tf.int64)], 0)


def split_rows(flat: np.ndarray, count: int) -> list[tuple[list[int], np.ndarray]]:
    """Each of ``count`` ranks' (tags, fingerprints) out of their allgathered rows."""
    rows, at = [], 0
    for _ in range(count):
        tags, prints = int(flat[at]), int(flat[at + 1])
        start = at + 2 + tags
        rows.append(([int(t) for t in flat[at + 2:start]], flat[start:start + prints]))
        at = start + prints
    return rows
