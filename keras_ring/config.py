"""Environment variables that configure keras_ring, read in one place with clear errors."""

from __future__ import annotations

import os
from dataclasses import dataclass

DEFAULT_TIMEOUT_SECONDS = 300.0


def _float(name: str, default: float, minimum: float = 0.0) -> float:
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


def _int(name: str, default: int, minimum: int = 1) -> int:
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


@dataclass(frozen=True)
class Config:
    """What the environment asks for; see the README's table of variables."""

    timeout_seconds: float
    segment_bytes: int
    host_id: str | None
    advertise_address: str | None

    @classmethod
    def from_env(cls) -> "Config":
        return cls(
            timeout_seconds=_float("KERAS_RING_TIMEOUT_SECONDS", DEFAULT_TIMEOUT_SECONDS),
            segment_bytes=_int("KERAS_RING_SEGMENT_BYTES", 1 << 20, minimum=64),
            host_id=os.environ.get("KERAS_RING_HOST_ID") or None,
            advertise_address=os.environ.get("KERAS_RING_ADVERTISE_ADDRESS") or None,
        )
