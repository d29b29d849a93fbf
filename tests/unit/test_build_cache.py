"""The build cache: a build this machine made before is copied, not compiled again; anything
that could change the library makes another key; a cache that cannot be used is a miss and
never fails a build.

The library in the cache is the real one `make venv` built for this environment (it is
exactly the build the key names); compiling is made to fail where a test proves it is skipped.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from keras_ring.ops import build, build_cache


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("KERAS_RING_BUILD_CACHE", str(root))
    return root


def _this_build_key() -> str:
    return build_cache.key(*build.build_inputs())


def _no_compiling(monkeypatch) -> None:
    def tripwire(*args, **kwargs):
        raise build.BuildError("the build compiled a source")

    monkeypatch.setattr(build, "_compile", tripwire)


def test_a_build_made_before_is_copied_instead_of_compiled(cache, tmp_path, monkeypatch, capsys):
    made = build.library_path()
    assert build.is_current(made, build.stamp()), "make venv should have built a current library"
    build_cache.store(_this_build_key(), made)
    _no_compiling(monkeypatch)
    out = tmp_path / "ops"
    path = build.ensure_built(out)
    assert path.read_bytes() == made.read_bytes()
    assert build.is_current(path, build.stamp())
    err = capsys.readouterr().err
    assert f"building {build.LIB_NAME} for TensorFlow" in err and "from the build cache" in err


def test_a_miss_or_a_cache_turned_off_compiles(cache, tmp_path, monkeypatch):
    _no_compiling(monkeypatch)
    with pytest.raises(build.BuildError, match="compiled a source"):
        build.build(tmp_path / "empty-cache")
    build_cache.store(_this_build_key(), build.library_path())
    monkeypatch.setenv("KERAS_RING_BUILD_CACHE", "0")
    assert build_cache.cache_dir() is None and build_cache.lookup(_this_build_key()) is None
    with pytest.raises(build.BuildError, match="compiled a source"):
        build.build(tmp_path / "cache-off")


def test_everything_that_goes_into_the_library_is_in_the_key(tmp_path):
    stamp = {"tf_version": "2.18.0", "sources": "abc", "python": "3.11.2"}
    base = build_cache.key(stamp, "g++", ["-O3"], ["-ltensorflow_framework"])
    other_compiler = tmp_path / "g++"
    other_compiler.write_text("#!/bin/sh\necho 'g++ (Other) 99.1'\n")
    other_compiler.chmod(0o755)
    variants = [
        build_cache.key(dict(stamp, tf_version="2.16.2"), "g++", ["-O3"], ["-ltensorflow_framework"]),
        build_cache.key(dict(stamp, sources="abd"), "g++", ["-O3"], ["-ltensorflow_framework"]),
        build_cache.key(dict(stamp, python="3.12.1"), "g++", ["-O3"], ["-ltensorflow_framework"]),
        build_cache.key(stamp, str(other_compiler), ["-O3"], ["-ltensorflow_framework"]),
        build_cache.key(stamp, "g++", ["-O2"], ["-ltensorflow_framework"]),
        build_cache.key(stamp, "g++", ["-O3"], ["-L/other", "-ltensorflow_framework"]),
    ]
    assert base == build_cache.key(stamp, "g++", ["-O3"], ["-ltensorflow_framework"])
    assert len({base, *variants}) == 1 + len(variants), variants


def test_a_cxx_with_a_launcher_is_keyed_by_the_compiler_behind_it(tmp_path):
    # CXX="ccache g++": the version banner is the compiler's, read through the launcher, and
    # the words after the launcher (compiler, flags) are part of the key.
    stamp = {"tf_version": "2.18.0", "sources": "abc", "python": "3.11.2"}
    compiler = tmp_path / "g++"
    compiler.write_text("#!/bin/sh\necho 'g++ (Other) 99.1'\n")
    compiler.chmod(0o755)
    launcher = tmp_path / "launcher"
    launcher.write_text('#!/bin/sh\nexec "$@"\n')
    launcher.chmod(0o755)
    assert "g++ (Other) 99.1" in build_cache._compiler_identity(f"{launcher} {compiler}")
    keys = {build_cache.key(stamp, cxx, ["-O3"], []) for cxx in
            (str(compiler), f"{launcher} {compiler}", f"{launcher} {compiler} -m64")}
    assert len(keys) == 3


def test_a_framework_library_reinstalled_in_place_is_another_key(tmp_path):
    stamp = {"tf_version": "2.18.0", "sources": "abc", "python": "3.11.2"}
    framework = tmp_path / "libtensorflow_framework.so.2"
    framework.write_bytes(b"\x7fELF one build")
    link = [f"-L{tmp_path}", "-l:libtensorflow_framework.so.2"]
    first = build_cache.key(stamp, "g++", ["-O3"], link)
    assert first == build_cache.key(stamp, "g++", ["-O3"], link)
    framework.write_bytes(b"\x7fELF another build")  # same name, same version string
    os.utime(framework, ns=(1, 1))
    assert build_cache.key(stamp, "g++", ["-O3"], link) != first


def test_the_newest_entries_are_kept_and_a_hit_counts_as_new(cache, tmp_path):
    lib = tmp_path / "lib.so"
    lib.write_bytes(b"\x7fELF library")
    keys = [f"entry{i}" for i in range(build_cache.MAX_ENTRIES)]
    for age, k in enumerate(keys):  # entry0 is the oldest
        build_cache.store(k, lib)
        os.utime(cache / k, (1_000_000 + age, 1_000_000 + age))
    assert build_cache.lookup("entry0") == cache / "entry0" / build_cache.LIB_NAME  # now newest
    build_cache.store("newcomer", lib)
    kept = sorted(p.name for p in cache.iterdir())
    assert kept == sorted(["newcomer", "entry0", *keys[2:]]), kept  # entry1 was the oldest


def test_a_cache_that_cannot_be_written_or_read_is_a_miss(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("KERAS_RING_BUILD_CACHE", str(blocker / "cache"))
    lib = tmp_path / "lib.so"
    lib.write_bytes(b"\x7fELF library")
    build_cache.store("k", lib)  # no error
    assert build_cache.lookup("k") is None
    assert not list(tmp_path.glob("**/.*.so.*")), "a staged copy was left behind"


def test_a_half_written_entry_is_not_a_hit(cache, tmp_path):
    (cache / "k").mkdir(parents=True)
    (cache / "k" / f".{build_cache.LIB_NAME}.12345").write_bytes(b"\x7fEL")  # a writer died
    assert build_cache.lookup("k") is None
