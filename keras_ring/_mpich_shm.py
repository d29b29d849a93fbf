"""MPICH shared-memory segments that a stopped job left behind in ``/dev/shm``.

MPICH's ``MPI_Init`` makes ``/dev/shm/mpich_shm_<id>_<n>`` for the ranks of one host and only
``MPI_Finalize`` removes it: a rank stopped inside ``MPI_Init`` (another failed before
``init()``) or killed by mpirun leaves 2 MiB there for good, and a container's 64 MiB
``/dev/shm`` is full after some thirty failed starts. Once its job has ended,
``keras-ring-run`` removes the segments its own ranks held (each rank's wrapper names the one
it saw its rank open), if they appeared while the job ran, belong to this user and no process
in sight holds them. Only the job's own: another job's holders may be out of sight (a
container that shares ``/dev/shm`` has its own PIDs), and removing a segment that job's
ranks are still opening makes them wait for each other in ``MPI_Init`` for ever.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Collection

DIRECTORY = "/dev/shm"
_PREFIX = "mpich_shm_"


def remove_orphans(since: float, segments: Collection[tuple[str, int]],
                   directory: str = DIRECTORY) -> list[str]:
    """Removes those of ``segments`` ((name, inode): the job's) that are this user's MPICH
    segments in ``directory``, made at ``since`` (a ``time.time()``) or later, and that no
    process maps or has open; returns their paths."""
    found = _candidates(since, set(segments), directory)
    for key in _held(found):
        del found[key]
    removed = []
    for (dev, ino), path in found.items():
        try:
            st = os.lstat(path)
            if (st.st_dev, st.st_ino) == (dev, ino):  # still that very file
                os.unlink(path)
                removed.append(path)
        except OSError:
            pass
    return removed


def _candidates(since: float, segments: set[tuple[str, int]],
                directory: str) -> dict[tuple[int, int], str]:
    found = {}
    names = {name for name, _ in segments}
    if not names:
        return found
    try:
        entries = list(os.scandir(directory))
    except OSError:  # no /dev/shm here
        return found
    for entry in entries:
        if not entry.name.startswith(_PREFIX) or entry.name not in names:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if ((entry.name, st.st_ino) in segments and stat.S_ISREG(st.st_mode)
                and st.st_uid == os.geteuid() and st.st_ctime >= since):
            found[(st.st_dev, st.st_ino)] = entry.path
    return found


def _held(found: dict[tuple[int, int], str]) -> set[tuple[int, int]]:
    """Which of ``found`` some process maps or has open (processes we may not inspect are
    other users', which cannot open our segments)."""
    if not found:
        return set()
    by_path = {path: key for key, path in found.items()}
    held = set()
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
                for line in f:
                    fields = line.split(maxsplit=5)
                    key = by_path.get(fields[5].rstrip("\n")) if len(fields) == 6 else None
                    if key is not None and int(fields[4]) == key[1]:
                        held.add(key)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                # The link's text only: stat would follow it, onto a hung network file.
                key = by_path.get(os.readlink(f"/proc/{pid}/fd/{fd}"))
                if key is not None:
                    held.add(key)
        except (OSError, ValueError):  # gone meanwhile, or not ours to read
            continue
    return held
