"""The supported TensorFlow/Keras range is enforced early, with messages naming the minimum."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import keras
import pytest
import tensorflow as tf

import keras_ring
from keras_ring import _keras_private


@pytest.mark.parametrize("tf_version, keras_version, says", [
    ("2.15.1", "2.15.0", "TensorFlow >= 2.16"),
    ("2.16.2", "3.3.3", "Keras >= 3.5.0; this environment has Keras 3.3.3"),
    ("2.16.2", "3.4.1", "pip install -U 'keras>=3.5.0'"),
    ("2.17.0rc1", "3.0.0", "Keras >= 3.5.0"),
])
def test_too_old_pairs_are_refused_naming_the_minimum(tf_version, keras_version, says):
    assert says in _keras_private.version_problem(tf_version, keras_version)


@pytest.mark.parametrize("tf_version, keras_version", [
    ("2.16.2", "3.5.0"), ("2.21.0", "3.15.1"), ("2.22.0rc0", "3.16.0.dev2026"),
    ("2.16.1", "3.10.0"), (tf.__version__, keras.__version__),
])
def test_supported_pairs_pass(tf_version, keras_version):
    assert _keras_private.version_problem(tf_version, keras_version) is None


def test_another_keras_backend_is_refused_at_init_naming_it(monkeypatch):
    assert _keras_private.backend_problem("tensorflow") is None
    was_initialized = keras_ring.is_initialized()  # by an earlier test of this process
    keras_ring.shutdown()
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    with pytest.raises(ImportError, match=r"TensorFlow backend; this process runs Keras with "
                                          r"the 'jax' backend.*KERAS_BACKEND=tensorflow"):
        keras_ring.init()
    assert not keras_ring.is_initialized()
    monkeypatch.undo()
    if was_initialized:
        keras_ring.init()


def test_a_backend_keras_cannot_import_is_named_at_init(clean_env):
    # KERAS_BACKEND=jax where JAX is not installed: a bare "No module named 'jax'" from deep
    # inside Keras, on every rank, never saying that keras_ring needs TensorFlow's backend.
    program = ("import keras_ring\n"
               "try:\n    keras_ring.init()\n"
               "except ImportError as e:\n    print('ImportError:', e)\n")
    if importlib.util.find_spec("jax") is not None:  # never in the project's venv
        pytest.skip("JAX is installed here: Keras would import it")
    env = dict(clean_env, KERAS_BACKEND="jax")
    proc = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True,
                          text=True, timeout=120)
    assert "ImportError: keras_ring needs Keras's TensorFlow backend" in proc.stdout, (
        proc.stdout + proc.stderr)
    assert "with 'jax' Keras could not even be imported here" in proc.stdout, proc.stdout


class _RenamedInternals(keras.optimizers.SGD):
    """An optimizer as a Keras that renamed its raw step counter would make it."""

    def __getattribute__(self, name):
        if name == "_iterations":
            raise AttributeError(name)
        return super().__getattribute__(name)


def test_wrap_refuses_accumulation_it_cannot_read_before_training():
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=2.*no _iterations"):
        keras_ring.wrap(_RenamedInternals(0.1, gradient_accumulation_steps=2))
    # Without accumulation the same optimizer needs nothing private.
    assert keras_ring.wrap(_RenamedInternals(0.1)) is not None
