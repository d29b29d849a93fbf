"""The GPU side of the op library on a machine without a GPU (CI): every op has a GPU kernel
in the same library as the CPU one, and a missing NCCL is reported clearly.

What only a GPU can show (NCCL results, stream ordering on real hardware) is checked by
benchmarks/gpu_check.sh; the backend's host logic by the C++ tests (nccl_test.cc).
"""

import ctypes
import shutil
import subprocess

import pytest
import tensorflow as tf
from tensorflow.python.framework import kernels

from keras_ring import gpu
from keras_ring.ops import build
from keras_ring.ops.loader import library

OPS = ("KerasRingAllreduce", "KerasRingGroupedAllreduce", "KerasRingAllgather", "KerasRingBroadcast",
       "KerasRingReducescatter", "KerasRingAlltoall")


def _kernels(op):
    library()
    return {k.device_type: k for k in kernels.get_registered_kernels_for_op(op).kernel}


@pytest.mark.parametrize("op", OPS)
def test_every_op_has_a_gpu_kernel_next_to_its_cpu_kernel(op):
    assert set(_kernels(op)) == {"CPU", "GPU"}


@pytest.mark.parametrize("op", OPS)
def test_gpu_kernels_leave_int32_to_the_cpu(op):
    # TensorFlow keeps int32 tensors of GPU ops in host memory: NCCL must never see them.
    (constraint,) = _kernels(op)["GPU"].constraint
    allowed = {tf.dtypes.as_dtype(t) for t in constraint.allowed_values.list.type}
    expected = {tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int8, tf.uint8, tf.int64}
    if op in ("KerasRingAllgather", "KerasRingBroadcast", "KerasRingAlltoall"):
        expected.add(tf.bool)  # moved as bytes
    assert constraint.name == "T" and allowed == expected


def test_names_and_alltoall_splits_stay_in_host_memory_on_gpus():
    # The kernel reads the name and the splits when it builds the request and the worker
    # writes the received splits: all host memory, the data device memory.
    assert sorted(_kernels("KerasRingAlltoall")["GPU"].host_memory_arg) == [
        "received_splits", "splits", "tensor_name"]
    for op in OPS[:-1]:
        assert list(_kernels(op)["GPU"].host_memory_arg) == ["tensor_name"]


def test_small_host_int_collectives_are_pinned_to_the_cpu_as_tensorflow_pins_ops():
    # TensorFlow runs an eager op on small host int32/int64 inputs on the CPU though a GPU
    # is the default; the name, a string input, rules that out for every collective, so the
    # wrappers apply the rule (a step count must not become an NCCL call).
    from keras_ring.ops.wrappers import _small_host_ints as pinned

    assert pinned((tf.constant([1, 2], tf.int64),))
    assert pinned(([tf.constant(1), tf.constant(2)],))  # a grouped call's list
    assert pinned((tf.constant([3]), tf.constant([], tf.int32)))  # alltoall's splits
    assert not pinned((tf.constant([1.0]),))
    assert not pinned((tf.zeros([65], tf.int32),))  # over TensorFlow's 64 elements
    with tf.device("/CPU:0"):
        assert not pinned((tf.constant([1], tf.int64),))  # a device asked for: left alone


def _probe(dirs: str) -> tuple[int, int, str]:
    version = ctypes.c_int(-1)
    err = ctypes.create_string_buffer(4096)
    rc = library().c.keras_ring_nccl_probe(dirs.encode(), ctypes.byref(version), err, len(err))
    return rc, version.value, err.value.decode()


def test_missing_nccl_is_reported_with_what_to_install(tmp_path):
    rc, version, message = _probe(str(tmp_path))
    if rc == 0:
        pytest.skip(f"NCCL is installed here (version code {version})")
    assert rc == 9, message  # FailedPrecondition
    assert message.startswith("keras_ring: GPU collective needs NCCL: libnccl.so.2 not found")
    assert "install keras-ring[cuda] or nvidia-nccl-cu12" in message
    assert str(tmp_path) in message  # where it looked
    with pytest.raises(RuntimeError, match="libnccl.so.2 not found"):
        gpu.nccl_version()


# Every function the backend resolves; the stub reports NCCL 2.8.4 (old version encoding).
_STUB = "\n".join(
    [f'extern "C" int {name}() {{ return 0; }}' for name in (
        "ncclGetUniqueId", "ncclCommInitRank", "ncclCommGetAsyncError", "ncclCommAbort",
        "ncclCommDestroy", "ncclGroupStart", "ncclGroupEnd", "ncclAllReduce", "ncclBroadcast",
        "ncclAllGather", "ncclReduce", "ncclReduceScatter", "ncclSend", "ncclRecv",
        "ncclRedOpCreatePreMulSum", "ncclRedOpDestroy")]
    + ['extern "C" const char* ncclGetErrorString(int) { return "stub"; }',
       'extern "C" int ncclGetVersion(int* v) { *v = 2804; return 0; }']
)


def _build_stub(directory, source):
    """A libnccl.so.2 from `source` in `directory`; skips where none can be built or tried."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    if _probe("")[0] == 0:
        pytest.skip("a real NCCL is installed here and would be found first")
    (directory / "stub.cc").write_text(source)
    # No soname: a later lookup of "libnccl.so.2" by name cannot pick up this stub.
    subprocess.run([cxx, "-shared", "-fPIC", "-o", str(directory / "libnccl.so.2"),
                    str(directory / "stub.cc")], check=True)


def test_nccl_from_the_search_path_is_version_checked(tmp_path):
    _build_stub(tmp_path, _STUB)
    rc, _, message = _probe(f"/nonexistent:{tmp_path}")
    assert rc == 9, message
    assert f"NCCL 2.8.4 ({tmp_path}/libnccl.so.2) is too old" in message
    assert "needs NCCL >= 2.12.0" in message


def test_an_nccl_without_a_function_keras_ring_calls_is_named(tmp_path):
    stub = "\n".join(line for line in _STUB.splitlines()
                     if "ncclSend" not in line and "ncclRecv" not in line)
    _build_stub(tmp_path, stub.replace("*v = 2804", "*v = 22304"))
    rc, _, message = _probe(str(tmp_path))
    assert rc == 9, message
    assert f"{tmp_path}/libnccl.so.2 lacks ncclSend, ncclRecv" in message
    assert "needs NCCL >= 2.12.0" in message


def test_the_gpu_free_build_is_one_library():
    # The CPU and GPU kernels and the NCCL backend come from the same sources and library.
    names = {p.relative_to(build.CC_DIR).as_posix() for p in build.sources()}
    assert {"tf/kernels.cc", "tf/gpu_kernels.cc", "core/nccl/backend.cc",
            "core/nccl/dynamic_api.cc", "core/nccl/scatter.cc"} <= names
    text = build.library_path().read_bytes()
    assert b"keras_ring_nccl_probe" in text and b"libnccl.so.2" in text
