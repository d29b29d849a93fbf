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
import errno
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from keras_ring.ops import build_cache

PACKAGE_DIR = Path(__file__).resolve().parent
CC_DIR = PACKAGE_DIR / "cc"
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


def _writable(path: Path) -> bool:
    return os.access(path, os.W_OK)


def _user_dir() -> Path:
    try:
        return build_cache.user_cache()
    except RuntimeError:  # no $HOME and no passwd entry (a container's arbitrary uid)
        raise BuildError(
            "keras_ring's package directory is read-only and there is no home directory to "
            "build its op library in. Set KERAS_RING_OPS_DIR to a writable directory."
        ) from None


def _build_dir() -> Path:
    """Where a build goes: $KERAS_RING_OPS_DIR when set, else the package directory when
    writable (source checkouts, venvs), else the user cache.

    The variable lets two environments with different TensorFlows share one source checkout
    (an editable install in each) without rebuilding over each other's library.
    """
    if os.environ.get("KERAS_RING_OPS_DIR"):
        return Path(os.environ["KERAS_RING_OPS_DIR"]).expanduser().resolve()
    if _writable(PACKAGE_DIR):
        return PACKAGE_DIR
    return _user_dir()


def default_output_dir(want: dict | None = None) -> Path:
    """Where the library is loaded from: where builds go (see :func:`_build_dir`), except that
    a read-only package directory holding a library current for ``want`` (default: this
    environment's stamp) is used as it is, unless the user cache holds a current one too.

    A root-owned install built ahead of time (``python -m keras_ring.ops`` as root) thus costs
    its users no compile and no compiler; the user's own build comes first because it is the
    one a ``--force`` rebuild (or the loader, after a failed load) made.
    """
    if os.environ.get("KERAS_RING_OPS_DIR") or _writable(PACKAGE_DIR):
        return _build_dir()
    if want is None:
        want = stamp()
    try:
        user = _user_dir()
    except BuildError:
        if is_current(library_path(PACKAGE_DIR), want):
            return PACKAGE_DIR
        raise
    if not is_current(library_path(user), want) and is_current(library_path(PACKAGE_DIR), want):
        return PACKAGE_DIR
    return user


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
    """The compiler command: $CXX, which may hold a launcher or flags ("ccache g++",
    "g++ -m64") and is split as a shell would, else the first of g++, c++, clang++ on PATH."""
    configured = os.environ.get("CXX", "")
    try:
        words = shlex.split(configured)
    except ValueError as e:
        raise BuildError(f"$CXX ({configured!r}) is not a valid command ({e}); set CXX to a "
                         f"C++17 compiler, or unset it, and run: {REBUILD_COMMAND}") from None
    if words:
        if shutil.which(words[0]) is None:
            raise BuildError(
                "keras_ring needs a C++17 compiler to build its TensorFlow op library, and $CXX "
                f"({configured!r}) names none: {words[0]!r} is not an executable on PATH. Set CXX "
                "to an installed compiler (or unset it to use g++, c++ or clang++ from PATH) "
                f"and run: {REBUILD_COMMAND}"
            )
        return configured
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if not cxx:
        raise BuildError(
            "keras_ring needs a C++17 compiler to build its TensorFlow op library, and none was "
            "found (looked for $CXX, g++, c++, clang++). Install one (e.g. 'apt-get install g++') "
            f"and run: {REBUILD_COMMAND}"
        )
    return shlex.quote(cxx)  # a command like $CXX: a path with spaces stays one word


class _Children:
    """The compilers and the linker of one build, so that a build that stops (Ctrl-C,
    SIGTERM, a failed source) stops them all, down to what they started (cc1plus, as).

    They stay in this process's group: a launcher that ends a rank by killing its group
    (keras-ring-run's guard, mpirun) must reach them too."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: set[subprocess.Popen[str]] = set()
        self._stopped = False

    def run(self, cmd: list[str]) -> subprocess.CompletedProcess[str]:
        proc: subprocess.Popen[str] | None = None
        try:
            # Started under the lock: stop() either sees a child or keeps it from starting.
            with self._lock:
                if self._stopped:
                    raise BuildError("the build was stopped")
                try:
                    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                            text=True)
                except OSError as e:
                    raise BuildError(f"could not run {shlex.join(cmd[:1])}: {e}") from None
                self._running.add(proc)
            out, err = proc.communicate()
        except BaseException:
            if proc is not None:
                self._kill(proc)
                proc.wait()
            raise
        finally:
            if proc is not None:
                with self._lock:
                    self._running.discard(proc)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            for proc in self._running:
                self._kill(proc)

    @staticmethod
    def _kill(proc: subprocess.Popen[str]) -> None:
        for pid in [*_descendants(proc.pid), proc.pid]:  # cc1plus first: the driver waits on it
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGTERM)


def _descendants(pid: int) -> list[int]:
    """The processes ``pid`` started, and theirs (Linux's /proc children lists)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
        for child in children:
            found += [child, *_descendants(child)]
    return found


def _compile(cxx: str, flags: list[str], src: Path, obj: Path,
             children: _Children | None = None) -> str:
    cmd = [*shlex.split(cxx), *flags, "-c", str(src), "-o", str(obj)]
    proc = (children or _Children()).run(cmd)
    if proc.returncode != 0:
        raise BuildError(f"compiling {src.name} failed:\n{shlex.join(cmd)}\n{proc.stderr}")
    return proc.stderr  # warnings, if any


def _wait_for_first_failure(futures: list[concurrent.futures.Future[str]]) -> None:
    """Until every source compiled or the first failed (not when the sources before it are
    done). In short waits: a SIGTERM that the kernel hands to a compiling thread only sets
    Python's flag, and the main thread runs the handler when it next wakes; in one long wait
    that was only when a compiler finished."""
    pending = set(futures)
    while pending:
        done, pending = concurrent.futures.wait(
            pending, timeout=0.2, return_when=concurrent.futures.FIRST_EXCEPTION)
        if any(f.exception() for f in done):
            return


def _compile_and_link(cxx: str, flags: list[str], link_flags: list[str], tmp: Path,
                      jobs: int | None) -> Path:
    """Compiles every source in parallel and links them in ``tmp``; warnings are printed."""
    srcs = sources()
    objs = [tmp / (s.parent.name + "_" + s.stem + ".o") for s in srcs]
    children = _Children()
    with concurrent.futures.ThreadPoolExecutor(jobs or os.cpu_count() or 2) as pool:
        futures = [pool.submit(_compile, cxx, flags, src, obj, children)
                   for src, obj in zip(srcs, objs)]
        try:
            _wait_for_first_failure(futures)
            failed = next((f.exception() for f in futures if f.done() and f.exception()), None)
            if failed is not None:
                raise failed
            warnings = [f.result() for f in futures]
        except BaseException:
            # Ctrl-C, SIGTERM or a failed source: the other compilers stop now, not when done.
            children.stop()
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    for w in warnings:
        if w.strip():
            print(w, file=sys.stderr)
    lib = tmp / LIB_NAME
    cmd = [*shlex.split(cxx), "-shared", "-o", str(lib), *map(str, objs), *link_flags,
           "-pthread", "-ldl"]
    proc = children.run(cmd)
    if proc.returncode != 0:
        raise BuildError(f"linking failed:\n{shlex.join(cmd)}\n{proc.stderr}")
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


def _unwritable(what: str, path: Path, e: OSError) -> BuildError:
    return BuildError(
        f"could not {what} {path} ({e.strerror or e}). Set KERAS_RING_OPS_DIR to a writable "
        "directory: the op library is built and loaded there."
    )


def _make_dir(out_dir: Path) -> None:
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # e.g. HOME=/nonexistent with a read-only package directory
        raise _unwritable("create the op library directory", out_dir, e) from None


def _publish(dest: Path, write: Callable[[Path], object]) -> None:
    """Writes ``dest`` through a staged file and an atomic rename: processes that already
    loaded the old file keep their mapping, and another user's file in a shared directory
    is replaced, not opened for writing."""
    staged = dest.parent / f".{dest.name}.{os.getpid()}"
    try:
        write(staged)
        os.replace(staged, dest)
    except OSError as e:
        raise _unwritable("write", dest, e) from None
    finally:
        with contextlib.suppress(OSError):
            staged.unlink(missing_ok=True)


class _Terminated(BaseException):
    """SIGTERM arrived during a build (see :func:`_terminate_cleanly`)."""


@contextlib.contextmanager
def _terminate_cleanly() -> Iterator[None]:
    """SIGTERM (a scheduler, mpirun, kill) unwinds a build the way Ctrl-C does, so that its
    compilers and temporary directory go too, then ends the process as SIGTERM would have.

    Only where Python can take the signal (the main thread) and nobody else handles it.
    """
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL):
        yield
        return

    def handler(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the cleanup
        raise _Terminated()

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    except _Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)
        raise
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def build(out_dir: Path | None = None, verbose: bool = True, jobs: int | None = None) -> Path:
    """Compiles and links the op library (or takes this exact build from the build cache);
    returns its path. Warnings are printed."""
    out_dir = out_dir or _build_dir()
    _make_dir(out_dir)
    want, cxx, flags, link_flags = build_inputs()
    lib = library_path(out_dir)
    if verbose:
        print(f"keras_ring: building {lib.name} for TensorFlow {want['tf_version']} ...",
              file=sys.stderr)
    entry = build_cache.key(want, cxx, flags, link_flags)
    cached = build_cache.lookup(entry)
    with _terminate_cleanly(), tempfile.TemporaryDirectory(prefix="keras_ring_build_") as tmp:
        built = cached or _compile_and_link(cxx, flags, link_flags, Path(tmp), jobs)
        if not cached:
            build_cache.store(entry, built)
        _publish(lib, lambda staged: shutil.copyfile(built, staged))
    _publish(_stamp_path(lib), lambda staged: staged.write_text(json.dumps(want)))
    if verbose:
        origin = f" (from the build cache, {cached.parent})" if cached else ""
        print(f"keras_ring: built {lib}{origin}", file=sys.stderr)
    return lib


def _open_lock(out_dir: Path) -> int:
    path = out_dir / ".build.lock"
    try:
        # Mode 0666 less the umask: in a directory shared by a group, the group can write it.
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise _unwritable("create the build lock", path, e) from None
        # another user's lock file, a read-only directory or file system
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)  # flock needs no write access
    except OSError as e:
        raise _unwritable("create the build lock", path, e) from None


@contextlib.contextmanager
def _build_lock(out_dir: Path) -> Iterator[None]:
    """Serialises builds: N ranks importing at once must not compile N times."""
    _make_dir(out_dir)
    fd = _open_lock(out_dir)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def ensure_built(out_dir: Path | None = None, force: bool = False) -> Path:
    """Returns the path of a library that matches this TensorFlow, building it if needed."""
    want = stamp()
    if out_dir is None:
        # A forced rebuild cannot go into a read-only package directory.
        out_dir = _build_dir() if force else default_output_dir(want)
    lib = library_path(out_dir)
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
    try:
        want = stamp()
        current = not args.force and is_current(
            library_path(args.out_dir or default_output_dir(want)), want)
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
