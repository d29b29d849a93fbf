"""Builds the op library against the TensorFlow installed in this environment.

Run ``python -m keras_ring.ops`` to (re)build by hand; the loader calls :func:`ensure_built`
on import, so a missing or stale library (another TensorFlow version, changed sources) is
rebuilt automatically when a C++ compiler is present. A build this machine has made before
(same TensorFlow, sources, compiler and flags) is copied from the build cache
(:mod:`keras_ring.ops.build_cache`) instead of compiled again.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from keras_ring.ops import build_cache

CC_DIR = Path(__file__).resolve().parent / "cc"
LIB_NAME = build_cache.LIB_NAME
REBUILD_COMMAND = f"{sys.executable} -m keras_ring.ops"


class BuildError(RuntimeError):
    """The op library could not be compiled."""


# The core runtime, its GPU backend (NCCL, loaded at run time: no CUDA headers), the adapter.
SOURCE_DIRS = ("core", "core/nccl", "tf")


def sources() -> list[Path]:
    """The C++ files of the op library: the core runtime and the TensorFlow adapter."""
    return [p for d in SOURCE_DIRS for p in sorted((CC_DIR / d).glob("*.cc"))]


def _source_hash() -> str:
    h = hashlib.sha256()
    for path in [p for d in SOURCE_DIRS for p in sorted((CC_DIR / d).glob("*")) if p.is_file()]:
        h.update(path.relative_to(CC_DIR).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def tf_flags() -> tuple[list[str], list[str], str]:
    """Compile flags, link flags and version of the installed TensorFlow.

    TensorFlow's include directories become -isystem so its headers' warnings do not bury ours;
    its ABI flag is kept exactly as TensorFlow states it.
    """
    import tensorflow as tf

    compile_flags = []
    for flag in tf.sysconfig.get_compile_flags():
        if flag.startswith("-I"):
            compile_flags += ["-isystem", flag[2:]]
        else:
            compile_flags.append(flag)
    return compile_flags, list(tf.sysconfig.get_link_flags()), tf.__version__


def stamp(tf_version: str | None = None) -> dict:
    """What the library must have been built from to be loadable here."""
    if tf_version is None:
        tf_version = tf_flags()[2]
    return {"tf_version": tf_version, "sources": _source_hash(), "python": sys.version.split()[0]}


def default_output_dir() -> Path:
    """$KERAS_RING_OPS_DIR when set, else the package directory when writable (source
    checkouts, venvs), else a user cache.

    The variable lets two environments with different TensorFlows share one source checkout
    (an editable install in each) without rebuilding over each other's library.
    """
    if os.environ.get("KERAS_RING_OPS_DIR"):
        return Path(os.environ["KERAS_RING_OPS_DIR"]).expanduser().resolve()
    pkg = Path(__file__).resolve().parent
    if os.access(pkg, os.W_OK):
        return pkg
    return build_cache.user_cache()


def library_path(out_dir: Path | None = None) -> Path:
    return (out_dir or default_output_dir()) / LIB_NAME


def _stamp_path(lib: Path) -> Path:
    return lib.with_suffix(".json")


def is_current(lib: Path, want: dict) -> bool:
    try:
        return lib.exists() and json.loads(_stamp_path(lib).read_text()) == want
    except (OSError, ValueError):
        return False


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if not cxx:
        raise BuildError(
            "keras_ring needs a C++17 compiler to build its TensorFlow op library, and none was "
            "found (looked for $CXX, g++, c++, clang++). Install one (e.g. 'apt-get install g++') "
            f"and run: {REBUILD_COMMAND}"
        )
    return cxx


def _compile(cxx: str, flags: list[str], src: Path, obj: Path) -> str:
    cmd = [cxx, *flags, "-c", str(src), "-o", str(obj)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"compiling {src.name} failed:\n{' '.join(cmd)}\n{proc.stderr}")
    return proc.stderr  # warnings, if any


def _compile_and_link(cxx: str, flags: list[str], link_flags: list[str], tmp: Path,
                      jobs: int | None) -> Path:
    """Compiles every source in parallel and links them in ``tmp``; warnings are printed."""
    srcs = sources()
    objs = [tmp / (s.parent.name + "_" + s.stem + ".o") for s in srcs]
    with concurrent.futures.ThreadPoolExecutor(jobs or os.cpu_count() or 2) as pool:
        warnings = list(pool.map(lambda so: _compile(cxx, flags, *so), zip(srcs, objs)))
    for w in warnings:
        if w.strip():
            print(w, file=sys.stderr)
    lib = tmp / LIB_NAME
    cmd = [cxx, "-shared", "-o", str(lib), *map(str, objs), *link_flags, "-pthread", "-ldl"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"linking failed:\n{' '.join(cmd)}\n{proc.stderr}")
    return lib


def build_inputs() -> tuple[dict, str, list[str], list[str]]:
    """What a build in this environment is made from: the stamp, the compiler, the compile
    flags and the link flags (together, the build cache's key)."""
    compile_flags, link_flags, tf_version = tf_flags()
    want = stamp(tf_version)
    info = f"tf={tf_version};src={want['sources']}"
    flags = [
        "-std=c++17", "-O3", "-fPIC", "-pthread", "-Wall", "-Wextra",
        f'-DKERAS_RING_BUILD_INFO="{info}"', *compile_flags,
    ]
    if sys.platform.startswith("linux"):
        # A compiler that links libstdc++ statically would export that copy, and TensorFlow's
        # libstdc++.so.6 (another GCC's, maybe) would mix locale facets with it: a crash in
        # the first message that prints a number (seen with gpu_check on a GPU machine).
        link_flags = [*link_flags, "-Wl,--exclude-libs,ALL"]
    return want, _compiler(), flags, link_flags


def build(out_dir: Path | None = None, verbose: bool = True, jobs: int | None = None) -> Path:
    """Compiles and links the op library (or takes this exact build from the build cache);
    returns its path. Warnings are printed."""
    out_dir = out_dir or default_output_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    want, cxx, flags, link_flags = build_inputs()
    lib = library_path(out_dir)
    if verbose:
        print(f"keras_ring: building {lib.name} for TensorFlow {want['tf_version']} ...",
              file=sys.stderr)
    entry = build_cache.key(want, cxx, flags, link_flags)
    cached = build_cache.lookup(entry)
    with tempfile.TemporaryDirectory(prefix="keras_ring_build_") as tmp:
        built = cached or _compile_and_link(cxx, flags, link_flags, Path(tmp), jobs)
        if not cached:
            build_cache.store(entry, built)
        # Atomic replace: processes that already loaded the old file keep their mapping.
        staged = out_dir / f".{LIB_NAME}.{os.getpid()}"
        shutil.copyfile(built, staged)
        os.replace(staged, lib)
    _stamp_path(lib).write_text(json.dumps(want))
    if verbose:
        origin = f" (from the build cache, {cached.parent})" if cached else ""
        print(f"keras_ring: built {lib}{origin}", file=sys.stderr)
    return lib


@contextlib.contextmanager
def _build_lock(out_dir: Path):
    """Serialises builds: N ranks importing at once must not compile N times."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".build.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_built(out_dir: Path | None = None, force: bool = False) -> Path:
    """Returns the path of a library that matches this TensorFlow, building it if needed."""
    out_dir = out_dir or default_output_dir()
    lib = library_path(out_dir)
    want = stamp()
    if not force and is_current(lib, want):
        return lib
    with _build_lock(out_dir):
        if not force and is_current(lib, want):  # another process built it meanwhile
            return lib
        return build(out_dir)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        description="Builds keras_ring's op library for the installed TensorFlow, unless the "
                    "library is already current (built for this TensorFlow from these sources).")
    parser.add_argument("--force", action="store_true", help="rebuild even when it is current")
    parser.add_argument("--if-needed", action="store_true",
                        help="the default; kept for scripts that pass it")
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    lib = library_path(args.out_dir or default_output_dir())
    current = not args.force and is_current(lib, stamp())
    try:
        path = ensure_built(args.out_dir, force=args.force)
    except BuildError as e:
        print(f"keras_ring: {e}", file=sys.stderr)
        return 1
    if current:
        print(f"keras_ring: {path} is current for this TensorFlow; nothing to do "
              "(--force rebuilds it)", file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
