"""What ``fit``'s epoch check compares of each optimizer besides its learning rate: the rest of
its configuration (momentum, clipnorm, weight_decay, a loss-scale optimizer's inner one, ...).

These are Python numbers, not variables, so no broadcast makes them equal: ranks that build
their optimizers differently apply the same averaged gradients differently and train apart,
silently. Each rank sends a 48-bit digest of its settings in the check's allgather; where the
digests differ, one more allgather of the settings themselves names what differs.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from keras_ring.errors import OptimizerMismatchError
from keras_ring.objects import allgather_object
from keras_ring.process_sets import ProcessSet

# Names may differ by rank (Keras numbers them as they are made); rates are compared as values.
_LEFT_OUT = frozenset({"name", "learning_rate"})
_CLASS = "class"  # shown alone where it differs: the other settings then differ as well


def settings(optimizer: Any) -> Any:
    """The optimizer's configuration without its name and learning rate (also those of an
    optimizer inside it), but with its learning-rate schedule's, in a form whose ``repr`` is
    the same on every rank; None where the optimizer cannot say (a custom one without
    ``get_config``)."""
    try:
        config = optimizer.get_config()
    except Exception as e:  # noqa: BLE001 - every rank must still take part in the check
        return f"no get_config ({type(e).__name__})"
    # __class__: a wrapped optimizer's reports the class it wraps.
    found = {**canonical(config), _CLASS: optimizer.__class__.__name__}
    schedule = config.get("learning_rate") if isinstance(config, dict) else None
    if isinstance(schedule, dict):  # a schedule's settings, unlike a rate, never change
        found["learning_rate"] = canonical(schedule)
    return found


def canonical(value: Any, left_out: frozenset = _LEFT_OUT, opaque: bool = False) -> Any:
    """``value`` (a Keras config) in a form whose ``repr`` is the same on every rank where
    the configs agree, without the dict keys in ``left_out`` at any depth. Numbers become
    ints where whole (below 2**53), else floats: 8, 8.0 and np.float64(8) are one setting,
    shown as 8; -0.0 is 0 and NaN "nan", which equals itself. Sets are sorted; other objects
    become their ``repr`` without an address, or with ``opaque`` their type alone (a repr may
    hold a name that Keras numbers per process)."""
    if isinstance(value, dict):
        return {str(k): canonical(v, left_out, opaque)
                for k, v in sorted(value.items(), key=lambda kv: str(kv[0])) if k not in left_out}
    if isinstance(value, (list, tuple)):
        return [canonical(v, left_out, opaque) for v in value]
    if isinstance(value, (set, frozenset)):  # its order follows the process's hash seed
        return sorted((canonical(v, left_out, opaque) for v in value), key=repr)
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
        number = float(value)  # 1, 1.0 and np.float64(1.0) are one setting, alike in digest too
        if number != number:
            return "nan"
        return int(number) if number.is_integer() and abs(number) < 2**53 else number + 0.0
    text = repr(value)  # an object: its address would differ by rank, its type does not
    return type(value).__qualname__ if opaque or " at 0x" in text else text


def digest(value: Any) -> float:
    """48 bits of the settings' hash, exact in the check's float64 row."""
    raw = hashlib.blake2b(repr(value).encode(), digest_size=6).digest()
    return float(int.from_bytes(raw, "little"))


def differences(first: Any, other: Any, first_rank: int, other_rank: int,
                 alone: str = _CLASS) -> str:
    """Up to four settings that differ between two ranks' ``canonical`` configs, each with
    both values; where ``alone`` differs (the class), only it, since the rest follows."""
    if not (isinstance(first, dict) and isinstance(other, dict)):
        return f"rank {first_rank} {first!r}, rank {other_rank} {other!r}"
    keys = sorted(k for k in set(first) | set(other) if first.get(k) != other.get(k))
    keys = [alone] if alone in keys else keys
    shown = "; ".join(f"{k}: rank {first_rank} {first.get(k)!r}, rank {other_rank} "
                      f"{other.get(k)!r}" for k in keys[:4])
    return shown + (", ..." if len(keys) > 4 else "")


def mismatch(optimizers: list[Any], ranks: list[int], epoch: int,
             process_set: ProcessSet) -> OptimizerMismatchError:
    """The error for digests that differ (every rank calls this alike: one allgather)."""
    mine = [settings(o) for o in optimizers]
    everyone = allgather_object(mine, name="keras_ring.optimizer_settings",
                                process_set=process_set)
    odd = next((i for i in range(1, len(everyone)) if everyone[i] != everyone[0]), 1)
    which = next((j for j in range(len(mine)) if everyone[odd][j] != everyone[0][j]), 0)
    shown = differences(everyone[0][which], everyone[odd][which], ranks[0], ranks[odd])
    error = OptimizerMismatchError.about(
        ranks[odd],
        f"keras_ring: the ranks' optimizers differ in settings other than the learning rate as "
        f"epoch {epoch} begins (optimizer '{getattr(optimizers[which], 'name', which)}'; "
        f"{shown}): they would apply the same averaged gradients differently and train apart. "
        "Build the optimizer alike on every rank. KERAS_RING_CHECK_WEIGHTS=0 (on every rank) "
        "turns this check off.")
    return error
