"""Where gpu_check finds its libraries: NCCL (the newest of the wheels', PyTorch's and the
system's, each probed in a child process) and the CUDA runtime, without importing PyTorch."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def nccl_version_string(code: int) -> str:
    wide = code >= 10000
    major, minor = (code // 10000, code % 10000 // 100) if wide else (code // 1000, code % 1000 // 100)
    return f"{major}.{minor}.{code % 100}"


def torch_lib_dirs() -> list[str]:
    """PyTorch's bundled libraries (its NCCL and CUDA runtime), without importing it."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return []
    return [str(Path(spec.origin).parent / "lib")] if spec and spec.origin else []


def nccl_candidates() -> list[str]:
    """Directories that may hold libnccl.so.2: wheels (NCCL's own, PyTorch's), the system's."""
    dirs = []
    from keras_ring.gpu import library_search_path

    dirs += [d for d in library_search_path().split(":") if d]
    dirs += torch_lib_dirs()
    try:
        ldconfig = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
        dirs += [str(Path(line.split("=>")[-1].strip()).parent)
                 for line in ldconfig.splitlines() if "libnccl.so.2" in line]
    except OSError:
        pass
    dirs += os.environ.get("LD_LIBRARY_PATH", "").split(":")
    cuda = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    dirs += [f"{cuda}/lib64", "/usr/lib/x86_64-linux-gnu", "/usr/local/nccl/lib", "/usr/lib64"]
    return list(dict.fromkeys(d for d in dirs if d and Path(d, "libnccl.so.2").exists()))


def find_nccl() -> tuple[str, int]:
    """The directory of the newest libnccl.so.2 here and its version code ("", 0 if none).
    Each candidate is asked in a child process: a library once loaded cannot be unloaded."""
    probe = ("import ctypes,sys; v=ctypes.c_int(0); "
             "ctypes.CDLL(sys.argv[1]).ncclGetVersion(ctypes.byref(v)); print(v.value)")
    best = ("", 0)
    for d in nccl_candidates():
        out = subprocess.run([sys.executable, "-c", probe, str(Path(d, "libnccl.so.2"))],
                             capture_output=True, text=True)
        code = int(out.stdout.strip() or 0) if out.returncode == 0 else 0
        found = nccl_version_string(code) if code else out.stderr.strip()[-200:]
        print(f"gpu_check: {d}/libnccl.so.2: {found}", file=sys.stderr)
        if code > best[1]:
            best = (d, code)
    return best


def cuda_runtime_dirs() -> list[str]:
    """Where a CUDA runtime may be besides the wheels: the toolkit's, PyTorch's."""
    dirs = [f"{os.environ.get('CUDA_HOME', '/usr/local/cuda')}/lib64", "/usr/local/cuda/lib64"]
    return [d for d in dict.fromkeys(dirs + torch_lib_dirs()) if Path(d).is_dir()]
