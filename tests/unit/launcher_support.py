"""What the keras-ring-run tests share: the launcher run as a script, and small rank programs
without TensorFlow (so these tests stay fast)."""

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / "keras_ring" / "launcher.py"
GUARD = 120  # seconds: a hang guard for every child process, never a timing assertion


def rank_program(tmp_path, body: str) -> str:
    """A rank program: ``body`` after ``import os, signal, sys`` and its ``RANK``."""
    path = tmp_path / "rank_program.py"
    path.write_text("import os, signal, sys\nRANK = int(os.environ['PMI_RANK'])\n"
                    + textwrap.dedent(body))
    return str(path)


def launch(mpirun, args, env, **kwargs) -> subprocess.Popen:
    cmd = [sys.executable, "-I", str(LAUNCHER), "--mpirun", mpirun, *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)


def run(mpirun, args, env) -> tuple[int, str, str]:
    proc = launch(mpirun, args, env)
    out, err = proc.communicate(timeout=GUARD)
    return proc.returncode, out.decode(), err.decode()
