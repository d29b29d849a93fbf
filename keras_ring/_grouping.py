"""Horovod's explicit gradient groups: which gradients share one collective.

By default gradients are fused by bytes (``_buckets.plan_buckets``). Horovod's
``DistributedOptimizer`` and ``DistributedGradientTape`` also take ``groups`` (and its older
spelling ``num_groups``): a number of groups to split the dense gradients into (sparse
ones travel apart, as allgathers), consecutive in variable order and as equal in count as
possible, or lists of variables whose gradients
travel together, every variable in no list alone. Groups decide how gradients travel,
never what they add up to.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from keras_ring import _keras_private


def variable_keys(variable: Any) -> set[int]:
    """Identities that name ``variable``: the object, and for a Keras variable its TF variable.

    Keras 3 variables are not hashable, so variables are compared by ``id``; a user may name
    either the ``keras.Variable`` or the ``tf.Variable`` behind it.
    """
    keys = {id(variable)}
    if isinstance(variable, _keras_private.variable_classes()):
        keys.add(id(variable.value))
    return keys


def is_variable(value: Any) -> bool:
    return isinstance(value, (tf.Variable, *_keras_private.variable_classes()))


def _describe(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}: {value!r}"


def _is_count(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass(frozen=True, eq=False)
class Groups:
    """A validated ``groups``: a count, or lists of variables (kept alive by this object)."""

    count: int | None = None
    lists: tuple[tuple[Any, ...], ...] = ()

    def __repr__(self) -> str:
        if self.count is not None:
            return f"Groups({self.count})"
        names = [[getattr(v, "path", None) or v.name for v in group] for group in self.lists]
        return f"Groups({names})"

    @classmethod
    def create(cls, who: str, groups: Any, num_groups: Any) -> "Groups | None":
        """``groups``/``num_groups`` checked as Horovod defines them; None if neither is set."""
        if not _is_count(num_groups) or num_groups < 0:
            raise ValueError(f"{who}: num_groups must be a non-negative int (0: no groups), "
                             f"got {num_groups!r}")
        if num_groups and groups is not None:  # Horovod lets groups win, and says so
            warnings.warn(f"{who}: num_groups={num_groups!r} is ignored: groups is given "
                          "(num_groups is Horovod's older name for groups=<int>)", stacklevel=4)
        elif num_groups:
            groups = int(num_groups)
        if groups is None:
            return None
        if _is_count(groups):
            if groups <= 0:
                raise ValueError(f"{who}: groups must be a positive int (the number of groups) "
                                 f"or a list of lists of variables, got {groups!r}")
            return cls(count=int(groups))
        if isinstance(groups, (str, bytes)) or not isinstance(groups, (list, tuple)):
            raise TypeError(f"{who}: groups must be a positive int or a list of lists of "
                            f"variables, got {_describe(groups)}")
        return cls(lists=cls._checked_lists(who, groups))

    @staticmethod
    def _checked_lists(who: str, groups: Sequence[Any]) -> tuple[tuple[Any, ...], ...]:
        seen: set[int] = set()
        lists = []
        for group in groups:
            if isinstance(group, (str, bytes)) or not isinstance(group, (list, tuple)):
                raise TypeError(f"{who}: each entry of groups must be a list of variables, "
                                f"got {_describe(group)}")
            for variable in group:
                if not is_variable(variable):
                    raise TypeError(f"{who}: groups must hold tf.Variable or keras.Variable "
                                    f"objects, got {_describe(variable)}")
                keys = variable_keys(variable)
                if keys & seen:
                    name = getattr(variable, "path", None) or variable.name
                    raise ValueError(f"{who}: variable '{name}' is in more than one group; "
                                     "a gradient travels in one collective")
                seen |= keys
            lists.append(tuple(group))
        return tuple(lists)

    def plan(self, count: int, sources: Sequence[Any] | None, who: str) -> list[list[int]]:
        """The collectives for ``count`` gradients, listed in the order they are sent.

        That order is the reverse of the variables' order; ``sources`` are the gradients'
        variables in it (None if unknown). Returns positions ``0..count-1``, one list per
        collective, in the order the collectives are issued: the group of the last
        variables first, so that communication starts as soon as backprop allows.
        """
        if self.count is not None:
            # Horovod's split of the gradients in variable order: the first (count % n)
            # groups one longer. Position count-1-v is variable order v.
            per, extra = divmod(count, self.count)
            bounds = [k * per + min(k, extra) for k in range(self.count + 1)]
            chunks = [[count - 1 - v for v in range(lo, hi)] for lo, hi in zip(bounds, bounds[1:])]
            return [sorted(chunk) for chunk in reversed(chunks) if chunk]
        if sources is None:
            raise ValueError(f"{who}: groups lists variables, but the variables of these "
                             "gradients are not known yet; pass them to apply()")
        owner = {key: g for g, group in enumerate(self.lists)
                 for variable in group for key in variable_keys(variable)}
        planned: list[list[int]] = []
        slot: dict[int, int] = {}  # group index -> its place in planned
        for position, source in enumerate(sources):
            group = next((owner[k] for k in variable_keys(source) if k in owner), None)
            if group is None:
                planned.append([position])
            elif group in slot:
                planned[slot[group]].append(position)
            else:
                slot[group] = len(planned)
                planned.append([position])
        return planned
