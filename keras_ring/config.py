"""Environment variables that configure keras_ring, read in one place with clear errors.

This module imports nothing of keras_ring, so every layer may use it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

DEFAULT_TIMEOUT_SECONDS = 300.0
# How long a process of a failed job may run on before keras_ring ends it (see README).
DEFAULT_FAILURE_EXIT_SECONDS = 5.0



def seconds_from_env(name: str, default: float, minimum: float = 0.0) -> float:
    """Variable ``name`` as seconds greater than ``minimum``; ``default`` when unset or empty.

    Raises:
        ValueError: the value is no number or too small; the message names the variable.
    """
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not value > minimum:
        raise ValueError(f"{name} must be greater than {minimum:g}, got {raw!r}")
    return value


def _seconds_or_off(name: str, default: float) -> float:
    """Seconds >= 0, where 0 switches the behaviour off."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds (0: off), got {raw!r}") from None
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{name} must be 0 (off) or a positive number of seconds, got {raw!r}")
    return value


def int_from_env(name: str, default: int, minimum: int = 1) -> int:
    """Variable ``name`` as an integer of at least ``minimum``; ``default`` when unset or empty.

    Raises:
        ValueError: the value is no integer or too small; the message names the variable.
    """
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {raw!r}")
    return value


def _bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be 1 or 0 (true/false), got {raw!r}")


def _power_of_two(name: str, default: int) -> int:
    value = int_from_env(name, default, minimum=4096)
    if value & (value - 1):
        raise ValueError(f"{name} must be a power of two, got {value}")
    return value


@dataclass(frozen=True)
class Config:
    """What the environment asks for; see the README's table of variables."""

    timeout_seconds: float
    stall_warning_seconds: float
    failure_exit_seconds: float  # 0: a failed process is never ended by keras_ring
    segment_bytes: int
    host_id: str | None
    advertise_address: str | None
    socket_ifname: str | None
    use_shm: bool
    shm_channel_bytes: int
    timeline_path: str | None
    intra_op_threads: int | None  # None: automatic; 0: leave TensorFlow's default

    @classmethod
    def from_env(cls) -> "Config":
        return cls(
            timeout_seconds=seconds_from_env("KERAS_RING_TIMEOUT_SECONDS",
                                             DEFAULT_TIMEOUT_SECONDS),
            stall_warning_seconds=seconds_from_env("KERAS_RING_STALL_WARNING_SECONDS", 60.0),
            failure_exit_seconds=_seconds_or_off("KERAS_RING_FAILURE_EXIT_SECONDS",
                                                 DEFAULT_FAILURE_EXIT_SECONDS),
            segment_bytes=int_from_env("KERAS_RING_SEGMENT_BYTES", 1 << 20, minimum=64),
            host_id=os.environ.get("KERAS_RING_HOST_ID") or None,
            advertise_address=os.environ.get("KERAS_RING_ADVERTISE_ADDRESS", "").strip() or None,
            socket_ifname=os.environ.get("KERAS_RING_SOCKET_IFNAME", "").strip() or None,
            use_shm=_bool("KERAS_RING_SHM", True),
            shm_channel_bytes=_power_of_two("KERAS_RING_SHM_CHANNEL_BYTES", 1 << 20),
            timeline_path=os.environ.get("KERAS_RING_TIMELINE") or None,
            intra_op_threads=(
                int_from_env("KERAS_RING_INTRA_OP_THREADS", 0, minimum=0)
                if os.environ.get("KERAS_RING_INTRA_OP_THREADS", "").strip() else None
            ),
        )
