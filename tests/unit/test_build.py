"""The op library is rebuilt, never loaded stale, when TensorFlow or the sources change."""

import fcntl
import json
import os
import select
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import tensorflow as tf

from keras_ring.ops import build, loader
from tests.unit.conftest import ends_within, signal_a_thread_of

REPO = Path(build.__file__).resolve().parents[2]


def test_stamp_names_this_tensorflow():
    s = build.stamp()
    assert s["tf_version"] == tf.__version__ and len(s["sources"]) == 16


def test_library_for_another_tensorflow_is_rebuilt(tmp_path):
    lib = build.library_path()
    assert build.is_current(lib, build.stamp()), "make venv should have built a current library"
    shutil.copy(lib, tmp_path / build.LIB_NAME)
    stale = dict(build.stamp(), tf_version="2.15.0")
    (tmp_path / "_keras_ring_ops.json").write_text(json.dumps(stale))
    assert not build.is_current(tmp_path / build.LIB_NAME, build.stamp())
    path = build.ensure_built(tmp_path)
    assert build.is_current(path, build.stamp())
    assert json.loads((tmp_path / "_keras_ring_ops.json").read_text())["tf_version"] == tf.__version__
    # The rebuilt binary carries its build info (loading a second copy would register the
    # ops twice in this process, so it is read, not loaded).
    assert f"tf={tf.__version__};src=".encode() in path.read_bytes()


def test_current_library_is_not_rebuilt(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("ensure_built rebuilt a current library")

    monkeypatch.setattr(build, "build", fail)
    assert build.ensure_built() == build.library_path()


def test_missing_compiler_error_names_the_rebuild_command(monkeypatch):
    monkeypatch.setenv("CXX", "")
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    try:
        build._compiler()
    except build.BuildError as e:
        assert "-m keras_ring.ops" in str(e) and "C++17 compiler" in str(e)
    else:
        raise AssertionError("no error without a compiler")


def test_gpu_free_build_has_cpu_kernels_for_every_op():
    from tensorflow.python.framework import kernels

    build.ensure_built()
    tf.load_op_library(str(build.library_path()))
    for op in ("KerasRingAllreduce", "KerasRingGroupedAllreduce", "KerasRingAllgather", "KerasRingBroadcast"):
        devices = {k.device_type for k in kernels.get_registered_kernels_for_op(op).kernel}
        assert "CPU" in devices, (op, devices)


def test_the_command_line_skips_a_current_library_and_says_so(capsys):
    # make venv built the library for this TensorFlow: nothing to compile (it took 35 s).
    assert build.main([]) == 0
    captured = capsys.readouterr()
    assert "is current for this TensorFlow; nothing to do (--force rebuilds it)" in captured.err
    assert captured.out.strip() == str(build.library_path(build.default_output_dir()))


def test_the_library_compiles_no_cpp_test_file():
    # The wheel leaves cc/tests out (pyproject.toml): building must not need them.
    sources = build.sources()
    assert sources and all("tests" not in p.relative_to(build.CC_DIR).parts for p in sources)


def test_the_library_is_loaded_once_per_process(monkeypatch):
    # Every op call asks for the library; checking it is current hashes every C++ source,
    # which must happen once, not per collective (it once cost milliseconds per eager call).
    from keras_ring.ops import loader

    first = loader.library()

    def no_second_check(*args, **kwargs):
        raise AssertionError("library() checked the build again")

    monkeypatch.setattr(build, "ensure_built", no_second_check)
    assert loader.library() is first


def test_the_library_exports_no_copy_of_libstdcxx():
    # A compiler that links libstdc++ statically must not export it next to TensorFlow's
    # libstdc++.so.6 (tests/unit/test_gpu_check.py builds that way and shows why).
    import subprocess

    assert "-Wl,--exclude-libs,ALL" in build.build_inputs()[3]
    build.ensure_built()
    exported = subprocess.run(["nm", "-D", "--defined-only", str(build.library_path())],
                              capture_output=True, text=True, check=True).stdout.split()
    assert not [name for name in exported if name.startswith(("_ZNSo", "_ZNSt6locale"))]


def _read_only_package(monkeypatch) -> Path:
    """Makes the package directory look read-only (a root-owned site-packages); returns it."""
    pkg = Path(build.__file__).resolve().parent
    real_access = os.access

    def access(path, mode, **kwargs):
        if mode & os.W_OK and Path(path) == pkg:
            return False
        return real_access(path, mode, **kwargs)

    monkeypatch.setattr(os, "access", access)
    monkeypatch.delenv("KERAS_RING_OPS_DIR", raising=False)
    return pkg


def _stale_stamp(monkeypatch) -> None:
    """This environment's stamp as if the sources had changed since the package was built."""
    want = dict(build.stamp(), sources="0" * 16)
    monkeypatch.setattr(build, "stamp", lambda tf_version=None: want)


def test_a_read_only_install_loads_the_library_built_ahead_of_time(tmp_path, monkeypatch):
    # Root ran `python -m keras_ring.ops` in site-packages: a user's job must load that library,
    # not compile it again (minutes) or fail on a node without a compiler.
    pkg = _read_only_package(monkeypatch)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    user = tmp_path / "cache" / "keras_ring"
    built = []

    def fake_build(out_dir=None, **kwargs):
        built.append(out_dir)
        return out_dir / build.LIB_NAME

    monkeypatch.setattr(build, "build", fake_build)
    assert build.default_output_dir() == pkg
    assert build.ensure_built() == pkg / build.LIB_NAME
    assert built == [] and not user.exists()
    # KERAS_RING_OPS_DIR still comes first.
    monkeypatch.setenv("KERAS_RING_OPS_DIR", str(tmp_path / "ops"))
    assert build.default_output_dir() == (tmp_path / "ops").resolve()
    monkeypatch.delenv("KERAS_RING_OPS_DIR")
    # A forced rebuild cannot write the package directory: it goes to the user cache.
    assert build.ensure_built(force=True) == user / build.LIB_NAME and built == [user]
    # A package library that is not current is rebuilt in the user cache, not used.
    real = build.stamp()
    _stale_stamp(monkeypatch)
    assert build.default_output_dir() == user
    assert build.ensure_built() == user / build.LIB_NAME and built == [user, user]
    # With both current, the user's own build comes first (what a --force rebuild made).
    monkeypatch.setattr(build, "stamp", lambda tf_version=None: real)
    (user / build.LIB_NAME).write_bytes(b"\x7fELF")
    (user / "_keras_ring_ops.json").write_text(json.dumps(real))
    assert build.is_current(pkg / build.LIB_NAME, real)
    assert build.default_output_dir() == user


def test_an_unwritable_home_is_an_error_naming_the_directory_and_the_variable(
        tmp_path, monkeypatch, capsys):
    _read_only_package(monkeypatch)
    _stale_stamp(monkeypatch)  # the package's library must be rebuilt, in the user cache
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    home = tmp_path / "a-file"  # root may create any directory, but none under a file
    home.write_text("")
    monkeypatch.setenv("HOME", str(home))
    user = home / ".cache" / "keras_ring"
    with pytest.raises(build.BuildError) as e:
        build.ensure_built()
    assert f"could not create the op library directory {user}" in str(e.value)
    assert "Set KERAS_RING_OPS_DIR to a writable directory" in str(e.value)
    with pytest.raises(loader.OpLibraryError, match="KERAS_RING_OPS_DIR"):
        loader.library.__wrapped__()  # what init() calls, without the per-process cache
    assert build.main([]) == 1
    err = capsys.readouterr().err
    assert f"{user}" in err and "KERAS_RING_OPS_DIR" in err and "Traceback" not in err


def test_another_users_lock_file_still_serialises_builds(tmp_path, monkeypatch):
    # A KERAS_RING_OPS_DIR shared between users: the lock file is whoever built first's (0644),
    # which this user cannot open for writing. Tests run as root, whom permissions do not stop,
    # so every way of opening it for writing is refused here instead.
    import builtins

    lock = tmp_path / ".build.lock"
    lock.write_text("")
    real_os_open, real_open = os.open, builtins.open

    def refuse(path):
        if Path(path) == lock:
            raise PermissionError(13, "Permission denied", str(path))

    def os_open(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR):
            refuse(path)
        return real_os_open(path, flags, *args, **kwargs)

    def open_(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+"):
            refuse(file)
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(builtins, "open", open_)
    with build._build_lock(tmp_path):
        other = real_os_open(lock, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):  # held: a second build would wait
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(other)
    other = real_os_open(lock, os.O_RDONLY)
    try:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released
    finally:
        os.close(other)


def test_cxx_may_hold_a_launcher_and_flags(tmp_path, monkeypatch):
    # CXX="ccache g++" or "g++ -m64" is a command, as make and distutils take it.
    launcher = tmp_path / "launcher"
    launcher.write_text('#!/bin/sh\necho "$@" > "$(dirname "$0")/args"\nexec "$@"\n')
    launcher.chmod(0o755)
    monkeypatch.setenv("CXX", f"{launcher} g++ -DFROM_CXX=1")
    src, obj = tmp_path / "a.cc", tmp_path / "a.o"
    src.write_text("#ifndef FROM_CXX\n#error the flags in CXX were dropped\n#endif\nint f() { return 1; }\n")
    build._compile(build._compiler(), ["-O0"], src, obj)
    assert obj.is_file()
    assert (tmp_path / "args").read_text().split() == ["g++", "-DFROM_CXX=1", "-O0", "-c", str(src),
                                                       "-o", str(obj)]


def test_a_cxx_that_is_not_installed_gets_the_missing_compiler_error(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/g++ -m64")
    with pytest.raises(build.BuildError) as e:
        build._compiler()
    message = str(e.value)
    assert "C++17 compiler" in message and "$CXX" in message and "'/nonexistent/g++'" in message
    assert "-m keras_ring.ops" in message


@pytest.mark.parametrize("to", ["process", "compiling thread"])
def test_sigterm_stops_the_compilers_and_removes_the_build_directory(tmp_path, to):
    # A scheduler or mpirun ending a rank mid-build: the compilers (and what they started, as
    # g++ starts cc1plus) must not run on for a minute, nor their temporary directory stay.
    # The kernel may hand a process's signal to any of its threads: the main thread, waiting
    # on the compiling threads, ran Python's handler only when a compiler ended (once, under
    # load, in a unit suite). tgkill sends it to one compiling thread on purpose.
    started = tmp_path / "started"
    os.mkfifo(started)
    compiler = tmp_path / "cxx"
    compiler.write_text(
        '#!/bin/sh\n'
        'if [ "$1" = --version ]; then echo "fake c++ 1.0"; exit 0; fi\n'
        'sleep 120 &\n'  # its "cc1plus"
        f'echo "$$ $!" > {started}\n'
        'wait\n')
    compiler.chmod(0o755)
    (tmp_path / "tmp").mkdir()
    script = (
        "import sys\nfrom pathlib import Path\nfrom keras_ring.ops import build\n"
        "tmp = Path(sys.argv[1])\n"
        "srcs = [tmp / 'a.cc', tmp / 'b.cc']\n"
        "build.sources = lambda: srcs\n"
        "build.build_inputs = lambda: ({'tf_version': 'x', 'sources': 'x', 'python': 'x'},\n"
        "                              str(tmp / 'cxx'), [], [])\n"
        "build.build(tmp / 'ops', jobs=2)\n")
    env = dict(os.environ, TMPDIR=str(tmp_path / "tmp"), KERAS_RING_BUILD_CACHE="0")
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], cwd=REPO, env=env,
                            stderr=subprocess.PIPE, text=True)
    fifo = os.open(started, os.O_RDWR)  # read-write: no end of file between the two writers
    pids: list[int] = []
    try:
        text = b""
        while text.count(b"\n") < 2:
            assert select.select([fifo], [], [], 120)[0], "the compilers did not start"
            text += os.read(fifo, 4096)
        pids = [int(p) for p in text.split()]
        # In the rank's process group: a launcher that kills it (keras-ring-run's guard,
        # mpirun) reaches the compilers too, where no cleanup of the build can run.
        assert {os.getpgid(pid) for pid in pids} == {os.getpgid(proc.pid)}
        assert list(tmp_path.joinpath("tmp").glob("keras_ring_build_*"))
        if to == "process":
            proc.send_signal(signal.SIGTERM)
        else:
            signal_a_thread_of(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == -signal.SIGTERM, proc.stderr.read()
        assert all(ends_within(pid, 10) for pid in pids), "compilers outlived the build"
        assert not list(tmp_path.joinpath("tmp").iterdir()), "the build directory was left"
    finally:
        os.close(fifo)
        proc.kill()
        proc.wait()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
