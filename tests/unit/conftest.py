import os
import sys
from pathlib import Path

import pytest

from keras_ring.config import MPI_VARIABLE_PREFIXES

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


@pytest.fixture
def mpirun():
    """Path of the mpirun that the mpich wheel installed next to this Python."""
    path = VENV_BIN / "mpirun"
    assert path.exists(), f"no mpirun next to {sys.executable}"
    return str(path)


@pytest.fixture
def clean_env():
    """The environment for child processes, without launcher variables of our own process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(MPI_VARIABLE_PREFIXES)}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONPATH"] = str(ROOT)
    return env
