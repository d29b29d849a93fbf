"""Every example runs (one process, one short epoch) and ends with its summary line.

The four examples start together and run side by side: each is mostly TensorFlow start-up.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from keras_ring.config import MPI_VARIABLE_PREFIXES

ROOT = Path(__file__).resolve().parents[2]

EXAMPLES = {
    "keras_fit.py": (["--epochs", "1", "--samples", "2048"],
                     r"final val_accuracy \(averaged over 1 ranks\): 0\.\d\d"),
    "custom_loop.py": (["--epochs", "2"], r"epoch 2: loss \(averaged over 1 ranks\) \d+\.\d{4}"),
    "mixed_precision.py": (["--epochs", "1"], r"final accuracy \(averaged over 1 ranks\): \d\.\d\d"),
    "embedding_sparse.py": (["--epochs", "1", "--sparse-as-dense"],
                            r"embedding gradients by dense allreduce; final val_accuracy .*: \d\.\d\d"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, clean_env_module):
    tmp = tmp_path_factory.mktemp("examples")
    procs = {}
    for script, (args, _) in EXAMPLES.items():
        if script == "keras_fit.py":
            args = args + ["--checkpoint", str(tmp / "best.keras")]
        procs[script] = subprocess.Popen(
            [sys.executable, str(ROOT / "examples" / script), *args], env=clean_env_module,
            cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = {name: (*p.communicate(timeout=300), p.returncode) for name, p in procs.items()}
    return tmp, results


@pytest.fixture(scope="module")
def clean_env_module():
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(MPI_VARIABLE_PREFIXES)}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONPATH"] = str(ROOT)
    return env


@pytest.mark.parametrize("script", sorted(EXAMPLES))
def test_example_runs(runs, script):
    tmp, results = runs
    stdout, stderr, code = results[script]
    assert code == 0, stderr[-3000:]
    lines = stdout.strip().splitlines()
    assert re.fullmatch(EXAMPLES[script][1], lines[-1]), lines[-3:]
    if script == "keras_fit.py":
        assert (tmp / "best.keras").exists()
