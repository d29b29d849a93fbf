"""Callbacks that write files, run by several ranks on the same files.

``keras.callbacks.ModelCheckpoint`` on every rank (the one-process program moved to N ranks,
without ``on_rank_zero``) makes every rank write the same checkpoint: Keras writes each
rank's own ``config.json`` into the ``.keras`` archive, and the writes interleave into files
that no longer load ("Bad CRC-32"), while the job exits 0. ``CSVLogger`` lines interleave
the same way; ``BackupAndRestore`` in one directory fails later on a file lock.

A file is known by the machine's boot id and the device and inode of its nearest existing
directory, then the rest of its path: the same path on two machines' own disks is two files,
and two containers of one machine that see one directory write one file. (The same path on
a network file system, seen from two machines, counts as two files: that sharing goes
unseen.) ``fit``'s first epoch check carries a flag saying that this rank's callbacks write
something; where any rank's does, one allgather of every rank's files finds those that
several ranks would write, and every rank fails before the first checkpoint is written
(``CSVLogger`` has opened its file by then), naming the ranks and the path.
"""

from __future__ import annotations

import os
from typing import Any

import keras

from keras_ring.objects import allgather_object
from keras_ring.process_sets import ProcessSet

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def _machine() -> str:
    try:
        with open(_BOOT_ID) as f:
            return f.read().strip()
    except OSError:
        import socket

        return socket.gethostname()


def _identity(path: str) -> str:
    """``device:inode/rest`` of ``path``: its nearest existing directory, then the rest."""
    parent, rest = os.path.realpath(path), []
    while not os.path.isdir(parent) and parent != os.path.dirname(parent):
        parent, tail = os.path.split(parent)
        rest.insert(0, tail)
    found = os.stat(parent)
    return f"{found.st_dev}:{found.st_ino}/{'/'.join(rest)}"


def _written_by(callback: Any) -> tuple[str, Any] | None:
    """(kind, path) of what ``callback`` writes on this rank, or None."""
    if isinstance(callback, keras.callbacks.ModelCheckpoint):
        # BestModelCheckpoint writes on rank 0 alone.
        writes = getattr(callback, "_writes", True) is not False
        return ("ModelCheckpoint", callback.filepath) if writes else None
    if isinstance(callback, keras.callbacks.CSVLogger):
        return "CSVLogger", callback.filename
    if isinstance(callback, keras.callbacks.BackupAndRestore):
        return "BackupAndRestore", callback.backup_dir
    return None


def written_files(callbacks: Any) -> list[tuple[str, str, str]]:
    """(identity, path, callback kind) of each file or directory that this rank's
    ``callbacks`` (the list given to ``fit``) write: ModelCheckpoint's file path (a
    template), CSVLogger's file, BackupAndRestore's directory. One this rank cannot resolve
    is left out (the check must not fail on some ranks only)."""
    if not isinstance(callbacks, (list, tuple)):
        return []
    machine, found = _machine(), []
    for callback in callbacks:
        try:
            written = _written_by(callback)
            if written is not None:
                path = os.fspath(written[1])
                found.append((f"{machine}:{_identity(path)}", os.path.realpath(path),
                              written[0]))
        except (OSError, TypeError, ValueError):
            continue
    return found


def collision(files: list[tuple[str, str, str]], ranks: list[int],
              process_set: ProcessSet) -> ValueError | None:
    """The error where several ranks would write one file, else None (every rank calls
    this alike: one allgather)."""
    everyone = allgather_object(files, name="keras_ring.shared_files", process_set=process_set)
    writers: dict[str, list[int]] = {}
    for rank, theirs in zip(ranks, everyone):
        for identity in dict.fromkeys(f[0] for f in theirs):
            writers.setdefault(identity, []).append(rank)
    shared = next((i for i, who in writers.items() if len(who) > 1), None)
    if shared is None:
        return None
    who = writers[shared]
    _, path, kind = next(f for theirs in everyone for f in theirs if f[0] == shared)
    if kind == "BackupAndRestore":
        advice = ("Give each rank a backup directory of its own, "
                  "f'backup/{keras_ring.rank()}' (a backup on rank 0 alone would resume "
                  "rank 0 alone)")
    else:
        advice = (f"Give the {kind} to rank 0 alone, keras_ring.callbacks.on_rank_zero("
                  f"keras.callbacks.{kind}(...)), or a path of each rank's own "
                  "(f'{keras_ring.rank()}/...')")
    return ValueError(
        f"keras_ring: ranks {', '.join(map(str, who))} would all write {path} (a {kind} given "
        "to fit on each of them): ranks writing one file corrupt it (each writes its own copy, "
        f"and the writes interleave). {advice}. "
        "KERAS_RING_CHECK_WEIGHTS=0 (on every rank) turns this check off, with the weight "
        "checks.")
