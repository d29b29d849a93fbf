"""The op library follows the TensorFlow of the environment that loads it.

Two environments share one library directory (``KERAS_RING_OPS_DIR``): the newest
TensorFlow (``.venv``, this test's interpreter) and the oldest supported one
(``.venv-oldest``, named by ``KERAS_RING_OTHER_PYTHON``, which ``make test-oldest`` sets).
Switching between them must rebuild with the one-line notice and then compute right, never
fail on undefined symbols; so must a library whose stamp lies about its TensorFlow.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# A world of one: init(), then an allreduce whose result proves the kernels run.
PROGRAM = """
import sys, tensorflow as tf, keras_ring
keras_ring.init()
out = keras_ring.allreduce(tf.constant([1.5, -2.0]), op=keras_ring.Sum)
print("RESULT", tf.__version__, out.numpy().tolist())
"""


@pytest.fixture(scope="module")
def other_python() -> str:
    path = os.environ.get("KERAS_RING_OTHER_PYTHON")
    assert path, "run through `make test-oldest`, which names the oldest pair's Python"
    assert Path(path).exists(), path
    return path


def _run(python: str, ops_dir: Path) -> tuple[str, list[str]]:
    env = {**os.environ, "KERAS_RING_OPS_DIR": str(ops_dir), "PYTHONPATH": str(REPO),
           "TF_CPP_MIN_LOG_LEVEL": "3"}
    proc = subprocess.run([python, "-c", PROGRAM], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert len(result) == 1, proc.stdout
    notices = [line for line in proc.stderr.splitlines() if "keras_ring: building" in line]
    return result[0], notices


def _tf_version(python: str) -> str:
    return subprocess.run([python, "-c", "import tensorflow as tf; print(tf.__version__)"],
                          capture_output=True, text=True, check=True,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}).stdout.strip()


def _copy_current_library(to: Path) -> None:
    """The library `make venv` built for this interpreter's TensorFlow (saves a build)."""
    for name in ("_keras_ring_ops.so", "_keras_ring_ops.json"):
        shutil.copy2(REPO / "keras_ring" / "ops" / name, to / name)


def test_switching_tensorflow_rebuilds_with_one_notice(tmp_path, other_python):
    newest, oldest = _tf_version(sys.executable), _tf_version(other_python)
    assert newest != oldest, "the two environments must differ"
    _copy_current_library(tmp_path)
    result, notices = _run(sys.executable, tmp_path)
    assert result == f"RESULT {newest} [1.5, -2.0]" and notices == []  # current: no rebuild
    for python, version in [(other_python, oldest), (sys.executable, newest)]:
        result, notices = _run(python, tmp_path)
        assert result == f"RESULT {version} [1.5, -2.0]"
        assert notices == [f"keras_ring: building _keras_ring_ops.so for TensorFlow {version} ..."]


def test_a_library_with_a_false_stamp_is_rebuilt_not_an_undefined_symbol(tmp_path, other_python):
    _copy_current_library(tmp_path)  # built for the newest TensorFlow
    stamp_path = tmp_path / "_keras_ring_ops.json"
    stamp = json.loads(stamp_path.read_text())
    stamp["tf_version"] = _tf_version(other_python)  # ... but claims the oldest
    stamp["python"] = subprocess.run([other_python, "-c", "import sys; print(sys.version.split()[0])"],
                                     capture_output=True, text=True, check=True).stdout.strip()
    stamp_path.write_text(json.dumps(stamp))
    result, notices = _run(other_python, tmp_path)
    assert result == f"RESULT {stamp['tf_version']} [1.5, -2.0]"
    assert len(notices) == 1
