"""Checks of the callbacks' arguments that Horovod's callbacks also take."""

from __future__ import annotations

from typing import Any

from keras_ring.process_sets import ProcessSet


def check_device(device: Any, who: str) -> None:
    """Horovod's ``device`` (where its op ran): a string, accepted and ignored."""
    if not isinstance(device, str):
        raise TypeError(f"{who}: device is Horovod's placement string (ignored here), got "
                        f"{type(device).__name__}: {device!r}; pass process_set= by keyword")


def check_process_set(process_set: Any, who: str) -> ProcessSet:
    """A ``ProcessSet`` now, rather than a failure when the callback first runs."""
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"{who}: process_set must be a keras_ring.ProcessSet, got "
                        f"{type(process_set).__name__}: {process_set!r}")
    return process_set
