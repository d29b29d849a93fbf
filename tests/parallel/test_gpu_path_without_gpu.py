"""The GPU path on machines without a GPU, across real processes: a device collective
(through the op library's device C API, the entry the GPU kernels share) fails on every rank
alike with a message saying what is missing, and a rank whose tensor is on the GPU while the
others' are on the host is a placement mismatch, not a hang. The runtime stays usable.

Skipped (on every rank alike) where TensorFlow sees a GPU: benchmarks/gpu_check.sh covers that.
"""

import ctypes

import pytest
import tensorflow as tf

import keras_ring as kr
from keras_ring.ops.loader import library

pytestmark = pytest.mark.skipif(bool(tf.config.list_physical_devices("GPU")),
                                reason="a GPU is present: see benchmarks/gpu_check.sh")

FLOAT32, SUM = 2, 0


def _device_allreduce(buf, name: bytes | None) -> tuple[int, str]:
    c = library().c
    c.keras_ring_device_allreduce.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
        ctypes.c_double, ctypes.c_double, ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p,
        ctypes.c_char_p, ctypes.c_size_t]
    err = ctypes.create_string_buffer(4096)
    # Host memory posing as device memory: nothing may touch it, since no GPU is usable.
    rc = c.keras_ring_device_allreduce(ctypes.addressof(buf), ctypes.addressof(buf), len(buf),
                                       FLOAT32, SUM, 1.0, 1.0, 0, None, name, err, len(err))
    return rc, err.value.decode()


def _still_usable():
    assert kr.allreduce(tf.constant([1.0]), op=kr.Sum).numpy()[0] == kr.size()


def test_device_collective_without_gpu_fails_alike_on_every_rank(world):
    rank, _ = world
    buf = (ctypes.c_float * 4)(1, 2, 3, 4)
    rc, message = _device_allreduce(buf, b"gpu_grad")
    assert rc == 9, message  # FailedPrecondition: not fatal, nothing was sent
    assert f"allreduce 'gpu_grad' failed on rank {rank}: rank 0: " in message
    # Whatever is missing here (the CUDA runtime, a driver or device, NCCL), it is named.
    assert any(s in message for s in ("no libcudart.so.12 or libcudart.so.13 found",
                                      "cudaSetDevice failed", "libnccl.so.2 not found")), message
    assert list(buf) == [1, 2, 3, 4]
    verdicts = kr.allgather_object(message.split(": rank 0: ", 1)[1])
    assert len(set(verdicts)) == 1, verdicts
    _still_usable()


def test_gpu_tensor_on_one_rank_is_a_placement_mismatch(world):
    rank, _ = world
    if rank == 0:
        buf = (ctypes.c_float * 4)()
        rc, message = _device_allreduce(buf, None)
        assert rc == 9, message
        assert "placement mismatch: rank 0 has a tensor in GPU memory" in message
    else:
        with pytest.raises(kr.CollectiveMismatchError, match="placement mismatch: rank 0 has a "
                           "tensor in GPU memory, rank 1 has a "
                           "tensor in host memory"):
            kr.allreduce(tf.zeros([4]), op=kr.Sum)
    _still_usable()


def test_grouped_device_collective_without_gpu_fails_alike_and_names_itself(world):
    rank, _ = world
    c = library().c
    vp = ctypes.c_void_p
    c.keras_ring_device_grouped_allreduce.argtypes = [
        ctypes.POINTER(vp), ctypes.POINTER(vp), ctypes.POINTER(ctypes.c_int64),
        ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int, ctypes.c_double,
        ctypes.c_double, ctypes.c_int, vp, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    a, b = (ctypes.c_float * 3)(1, 2, 3), (ctypes.c_double * 2)(4, 5)
    pointers = (vp * 2)(ctypes.addressof(a), ctypes.addressof(b))
    err = ctypes.create_string_buffer(4096)
    rc = c.keras_ring_device_grouped_allreduce(
        pointers, pointers, (ctypes.c_int64 * 2)(3, 2), (ctypes.c_int * 2)(FLOAT32, 3), 2, SUM,
        1.0, 1.0, 0, None, b"gpu_bucket", err, len(err))
    message = err.value.decode()
    assert rc == 9, message
    assert f"grouped_allreduce 'gpu_bucket' failed on rank {rank}: rank 0: " in message
    assert list(a) == [1, 2, 3] and list(b) == [4, 5]
    # Nothing was made on this machine: no events, no communicators.
    events, comms = ctypes.c_int64(-1), ctypes.c_int64(-1)
    assert c.keras_ring_device_objects(ctypes.byref(events), ctypes.byref(comms)) == 0
    assert (events.value, comms.value) == (0, 0)
    verdicts = kr.allgather_object(message.split(": rank 0: ", 1)[1])
    assert len(set(verdicts)) == 1, verdicts
    _still_usable()


def _device_alltoall(buf, rows: int, splits: list[int], name: bytes) -> tuple[int, str, list[int]]:
    c = library().c
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    c.keras_ring_device_alltoall.argtypes = [
        vp, vp, i64, i64, i64, ctypes.POINTER(i64), ctypes.c_int, ctypes.POINTER(ctypes.c_int32),
        ctypes.c_int, ctypes.c_int, vp, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    err = ctypes.create_string_buffer(4096)
    received = (ctypes.c_int32 * kr.size())(*[-1] * kr.size())
    rc = c.keras_ring_device_alltoall(
        ctypes.addressof(buf), ctypes.addressof(buf), rows, 1, len(buf), (i64 * len(splits))(*splits),
        len(splits), received, FLOAT32, 0, None, name, err, len(err))
    return rc, err.value.decode(), list(received)


def test_device_reducescatter_and_alltoall_without_gpu_fail_alike_on_every_rank(world):
    rank, size = world
    c = library().c
    c.keras_ring_device_reducescatter.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
        ctypes.c_int, ctypes.c_double, ctypes.c_double, ctypes.c_int, ctypes.c_void_p,
        ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    a, out = (ctypes.c_float * (3 * size))(*range(3 * size)), (ctypes.c_float * 3)()
    err = ctypes.create_string_buffer(4096)
    rc = c.keras_ring_device_reducescatter(ctypes.addressof(a), ctypes.addressof(out), 3 * size,
                                           1, FLOAT32, SUM, 1.0, 1.0, 0, None, b"gpu_shard", err,
                                           len(err))
    scatter_message = err.value.decode()
    assert rc == 9, scatter_message
    assert f"reducescatter 'gpu_shard' failed on rank {rank}: rank 0: " in scatter_message
    assert list(out) == [0, 0, 0]
    buf = (ctypes.c_float * size)(*range(size))
    rc, message, received = _device_alltoall(buf, size, [1] * size, b"gpu_exchange")
    assert rc == 9, message
    assert f"alltoall 'gpu_exchange' failed on rank {rank}: rank 0: " in message
    verdicts = kr.allgather_object((scatter_message.split(": rank 0: ", 1)[1],
                                    message.split(": rank 0: ", 1)[1]))
    assert len(set(verdicts)) == 1, verdicts
    _still_usable()


def test_bad_device_alltoall_splits_are_refused_on_every_rank_before_any_gpu_work(world):
    # The splits of device tensors travel with the signatures too, so one rank's bad splits
    # are an argument error everywhere, naming it, even where no GPU could run the exchange.
    rank, size = world
    buf = (ctypes.c_float * size)(*range(size))
    splits = [1] * size if rank != size - 1 else [size] + [1] * (size - 1)
    rc, message, received = _device_alltoall(buf, size, splits, b"gpu_exchange")
    assert rc == 3, message  # InvalidArgument
    assert f"rank {size - 1} passed splits [{size}, " in message
    assert f"for a tensor of {size} rows" in message
    assert list(buf) == list(map(float, range(size)))
    _still_usable()
