"""Built op libraries kept per machine, so that returning to a TensorFlow (another environment,
a downgrade and back, a second library directory) costs a copy instead of a compile.

An entry is one directory holding one library, named by a key over everything that goes into
the build: the stamp (TensorFlow version, source hash, Python version), the compiler and its
version, every compile and link flag (which name the TensorFlow installation's include and
library directories) and the size and time of the framework library it links. A library is
only ever taken for exactly the build that made it.

The cache lives in ``$KERAS_RING_BUILD_CACHE`` (default ``~/.cache/keras_ring/builds``;
``0`` turns it off). The newest ``MAX_ENTRIES`` are kept. Every failure to read or write it
is a miss: the cache can make a build faster, never make one fail.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

LIB_NAME = "_keras_ring_ops.so"
MAX_ENTRIES = 8


def user_cache() -> Path:
    """keras_ring's directory in the user's cache ($XDG_CACHE_HOME, else ~/.cache)."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "keras_ring"


def cache_dir() -> Path | None:
    """Where entries live, or None when the cache is turned off."""
    configured = os.environ.get("KERAS_RING_BUILD_CACHE", "")
    if configured.strip().lower() in ("0", "off", "false", "no"):
        return None
    if configured:
        return Path(configured).expanduser()
    try:
        return user_cache() / "builds"
    except RuntimeError:  # no home directory: no cache, as when it is turned off
        return None


def _compiler_identity(cxx: str) -> str:
    """The compiler's resolved path, the launcher or flags $CXX holds with it ("ccache g++",
    "g++ -m64") and its version banner: a new compiler is a new key."""
    try:
        words = shlex.split(cxx) or [cxx]
    except ValueError:
        words = [cxx]
    path = shutil.which(words[0]) or words[0]
    try:
        banner = subprocess.run([path, *words[1:], "--version"], capture_output=True, text=True,
                                timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        banner = ""
    return "\n".join([os.path.realpath(path), *words[1:], banner])


def _linked_files(link_flags: list[str]) -> list[str]:
    """Size and modification time of each library named as ``-l:NAME`` in a ``-L`` directory
    (TensorFlow's framework library): a TensorFlow reinstalled in place is a new key."""
    dirs = [f[2:] for f in link_flags if f.startswith("-L")]
    found = []
    for name in (f[3:] for f in link_flags if f.startswith("-l:")):
        for d in dirs:
            with contextlib.suppress(OSError):
                st = os.stat(os.path.join(d, name))
                found.append(f"{d}/{name}:{st.st_size}:{st.st_mtime_ns}")
    return found


def key(stamp: dict, cxx: str, compile_flags: list[str], link_flags: list[str]) -> str:
    """The entry name of the library this exact build would produce."""
    material = json.dumps({"stamp": stamp, "compiler": _compiler_identity(cxx),
                           "compile": compile_flags, "link": link_flags,
                           "linked": _linked_files(link_flags)}, sort_keys=True)
    return hashlib.sha256(material.encode()).hexdigest()[:24]


def lookup(entry_key: str) -> Path | None:
    """The cached library of this key, or None. A hit counts as a use (kept longer)."""
    root = cache_dir()
    if root is None:
        return None
    lib = root / entry_key / LIB_NAME
    try:
        if not lib.is_file():
            return None
        os.utime(lib.parent)
    except OSError:
        return None
    return lib


def store(entry_key: str, lib: Path) -> None:
    """Keeps a freshly built library under its key, then drops the oldest entries."""
    root = cache_dir()
    if root is None:
        return
    entry = root / entry_key
    staged = entry / f".{LIB_NAME}.{os.getpid()}"
    try:
        entry.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(lib, staged)
        os.replace(staged, entry / LIB_NAME)  # readers never see a half-written library
        _prune(root)
    except OSError:
        with contextlib.suppress(OSError):
            staged.unlink(missing_ok=True)


def _prune(root: Path) -> None:
    entries = sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime,
                     reverse=True)
    for old in entries[MAX_ENTRIES:]:
        shutil.rmtree(old, ignore_errors=True)
