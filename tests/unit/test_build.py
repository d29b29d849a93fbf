"""The op library is rebuilt, never loaded stale, when TensorFlow or the sources change."""

import json
import shutil

import tensorflow as tf

from keras_ring.ops import build


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
