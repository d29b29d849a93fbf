"""Callbacks that write files, run by several ranks of one host on the same paths.

``keras.callbacks.ModelCheckpoint`` on every rank (the one-process program moved to N ranks,
without ``on_rank_zero``) makes every rank write the same checkpoint: Keras writes each
rank's own ``config.json`` into the ``.keras`` archive, and the writes interleave into files
that no longer load ("Bad CRC-32"), while the job exits 0. ``CSVLogger`` lines interleave
the same way; ``BackupAndRestore`` in one directory fails later on a file lock. ``fit``'s
first epoch check carries a digest of the paths this rank's callbacks write (with the host
name: the same path on two hosts is two files); ranks whose digests are equal write the same
files, and every rank fails before anything is written, naming the ranks and the paths.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import keras

from keras_ring._optimizer_settings import digest as _digest
from keras_ring.objects import allgather_object
from keras_ring.process_sets import ProcessSet


def written_paths(callbacks: Any) -> list[str]:
    """``host:path`` of each file or directory that this rank's ``callbacks`` (a list given
    to ``fit``) write: ModelCheckpoint's file path (a template), CSVLogger's file,
    BackupAndRestore's directory; a ModelCheckpoint that does not write on this rank
    (``BestModelCheckpoint`` off rank 0) is left out."""
    if not isinstance(callbacks, (list, tuple)):
        return []
    host, found = socket.gethostname(), []
    for callback in callbacks:
        if isinstance(callback, keras.callbacks.ModelCheckpoint):
            path = None if getattr(callback, "_writes", True) is False else callback.filepath
        elif isinstance(callback, keras.callbacks.CSVLogger):
            path = callback.filename
        elif isinstance(callback, keras.callbacks.BackupAndRestore):
            path = callback.backup_dir
        else:
            continue
        if path is not None:
            found.append(f"{host}:{os.path.realpath(os.fspath(path))}")
    return sorted(found)


def digest(paths: list[str]) -> float:
    """48 bits of the paths' hash (exact in a float64); 0.0 where there are none."""
    return _digest(paths) if paths else 0.0


def shared(digests: list[float]) -> bool:
    """Whether two ranks' digests say they write the same paths."""
    written = [d for d in digests if d != 0.0]
    return len(set(written)) < len(written)


def collision(paths: list[str], ranks: list[int], process_set: ProcessSet) -> ValueError:
    """The error for ranks that write the same paths (every rank calls this alike: one
    allgather names them)."""
    everyone = allgather_object(paths, name="keras_ring.shared_files", process_set=process_set)
    path = next((p for i, mine in enumerate(everyone) for p in mine
                 if any(p in other for other in everyone[i + 1:])), "the same paths")
    writers = [ranks[j] for j, theirs in enumerate(everyone) if path in theirs]
    return ValueError(
        f"keras_ring: ranks {', '.join(map(str, writers))} would all write {path} (a "
        "ModelCheckpoint, CSVLogger or BackupAndRestore given to fit on each of them): ranks "
        "writing one file corrupt it (each writes its own copy of the model's configuration "
        "into a checkpoint, and the writes interleave). Give the callback to rank 0 alone, "
        "keras_ring.callbacks.on_rank_zero(keras.callbacks.ModelCheckpoint(...)), or a path "
        "of each rank's own (f'ckpt-{keras_ring.rank()}/...'). KERAS_RING_CHECK_WEIGHTS=0 "
        "(on every rank) turns this check off.")
