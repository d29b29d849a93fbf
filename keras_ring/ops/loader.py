"""Loads the op library once per process: the TensorFlow ops and the runtime's C API.

A library built for another TensorFlow is rebuilt here instead of failing later with an
undefined-symbol error; where that is impossible the error names the command that rebuilds.
"""

from __future__ import annotations

import ctypes
import functools
import types
from dataclasses import dataclass

from keras_ring.ops import build


class OpLibraryError(ImportError):
    """The op library is missing, stale, or does not load in this environment."""


@dataclass(frozen=True)
class Library:
    """The loaded op library: `ops` holds the generated op functions, `c` the C API."""

    ops: types.ModuleType
    c: ctypes.CDLL
    path: str


class NativeConfig(ctypes.Structure):
    """Mirror of ``keras_ring_config`` in cc/tf/c_api.h (same order, same types)."""

    _fields_ = [
        ("rank", ctypes.c_int),
        ("size", ctypes.c_int),
        ("listen_fd", ctypes.c_int),
        ("hosts", ctypes.POINTER(ctypes.c_char_p)),
        ("ports", ctypes.POINTER(ctypes.c_int)),
        ("host_index", ctypes.POINTER(ctypes.c_int)),
        ("job_token", ctypes.c_uint64),
        ("timeout_seconds", ctypes.c_double),
        ("stall_warning_seconds", ctypes.c_double),
        ("segment_bytes", ctypes.c_size_t),
        ("use_shm", ctypes.c_int),
        ("shm_channel_bytes", ctypes.c_size_t),
        ("timeline", ctypes.c_int),
        ("failure_exit_seconds", ctypes.c_double),
        ("process_set_id", ctypes.c_int),
        ("fast_agree", ctypes.c_int),
        ("doubling_max_bytes", ctypes.c_size_t),
        ("device_max_in_flight", ctypes.c_int),
        ("sync_graph_kernels", ctypes.c_int),
        ("huge_page_output_bytes", ctypes.c_size_t),
    ]


def _declare_c_api(c: ctypes.CDLL) -> None:
    c.keras_ring_init.argtypes = [ctypes.POINTER(NativeConfig), ctypes.c_char_p, ctypes.c_size_t]
    c.keras_ring_init.restype = ctypes.c_int
    c.keras_ring_timeline_read.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    c.keras_ring_timeline_read.restype = ctypes.c_size_t
    c.keras_ring_timeline_record.argtypes = [ctypes.c_int]
    c.keras_ring_timeline_record.restype = None
    c.keras_ring_timeline_spill.argtypes = [ctypes.c_int, ctypes.c_longlong]
    c.keras_ring_timeline_spill.restype = ctypes.c_int
    c.keras_ring_fail_job.argtypes = [ctypes.c_int, ctypes.c_char_p]
    c.keras_ring_fail_job.restype = ctypes.c_int
    c.keras_ring_error_info.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    c.keras_ring_error_info.restype = ctypes.c_size_t
    c.keras_ring_shutdown_with_error.argtypes = [ctypes.c_char_p]
    c.keras_ring_shutdown_with_error.restype = ctypes.c_int
    c.keras_ring_shutdown.argtypes = []
    c.keras_ring_shutdown.restype = ctypes.c_int
    c.keras_ring_shutdown_process_set.argtypes = [ctypes.c_int]
    c.keras_ring_shutdown_process_set.restype = ctypes.c_int
    c.keras_ring_is_initialized.argtypes = []
    c.keras_ring_is_initialized.restype = ctypes.c_int
    c.keras_ring_peer_stalled.argtypes = []
    c.keras_ring_peer_stalled.restype = ctypes.c_int
    c.keras_ring_leave_unfinalized_at_exit.argtypes = [ctypes.c_double, ctypes.c_int]
    c.keras_ring_leave_unfinalized_at_exit.restype = None
    c.keras_ring_bound_exit_after_failure.argtypes = [ctypes.c_double]
    c.keras_ring_bound_exit_after_failure.restype = None
    c.keras_ring_barrier.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p,
                                     ctypes.c_size_t]
    c.keras_ring_barrier.restype = ctypes.c_int
    c.keras_ring_join.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_char_p,
                                  ctypes.c_size_t]
    c.keras_ring_join.restype = ctypes.c_int
    c.keras_ring_install_signal_handler.argtypes = [ctypes.c_int]
    c.keras_ring_install_signal_handler.restype = ctypes.c_int
    c.keras_ring_build_info.argtypes = []
    c.keras_ring_build_info.restype = ctypes.c_char_p
    # GPU backend (cc/core/nccl/device_c_api.h): where NCCL is, and whether it loads.
    c.keras_ring_nccl_set_search_path.argtypes = [ctypes.c_char_p]
    c.keras_ring_nccl_set_search_path.restype = None
    c.keras_ring_nccl_probe.argtypes = [
        ctypes.c_char_p, ctypes.POINTER(ctypes.c_int), ctypes.c_char_p, ctypes.c_size_t,
    ]
    c.keras_ring_nccl_probe.restype = ctypes.c_int


def _load(path: str) -> Library:
    import tensorflow as tf

    ops = tf.load_op_library(path)
    # Same path, same handle: ctypes sees the very runtime the kernels use.
    c = ctypes.CDLL(path)
    _declare_c_api(c)
    return Library(ops=ops, c=c, path=path)


def describe_error(message: str) -> str:
    """The structure the library remembers for an error with this exact message
    ("code\\nrank\\ncollective\\nreason"), or "" when it knows none."""
    buf = ctypes.create_string_buffer(8192)
    library().c.keras_ring_error_info(message.encode(errors="replace"), buf, len(buf))
    return buf.value.decode(errors="replace")


# Loaded once per process: every op call asks for it, and checking that the library is
# current hashes every C++ source (milliseconds per eager collective if done each time).
@functools.lru_cache(maxsize=None)
def library() -> Library:
    """Returns the loaded library, building it first if it is missing or stale."""
    import tensorflow as tf

    try:
        path = build.ensure_built()
    except build.BuildError as e:
        raise OpLibraryError(f"keras_ring could not build its op library: {e}") from None
    try:
        return _load(str(path))
    except tf.errors.NotFoundError as e:
        # Typically "undefined symbol": built against another TensorFlow than the stamp says.
        try:
            path = build.ensure_built(force=True)
            return _load(str(path))
        except (build.BuildError, tf.errors.NotFoundError):
            raise OpLibraryError(
                f"keras_ring's op library {path} does not load with TensorFlow {tf.__version__}: "
                f"{e.message.strip()}\nRebuild it with: {build.REBUILD_COMMAND}"
            ) from None
